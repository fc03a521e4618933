"""Triton adapter: TensorRT-LLM's postprocessing model (ids -> text); the logic is trt_redrafter.serving.text."""

import json
import os
import sys

import numpy as np
import triton_python_backend_utils as pb_utils

# make-repo copies the text modules of trt_redrafter beside this file, so a stock tritonserver loads this model
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from trt_redrafter.serving.text import TextCodec

PASSTHROUGH = (("ACCEPTANCE_RATE", np.float32), ("TOTAL_ACCEPTED_DRAFT_TOKENS", np.int32),
               ("TOTAL_DRAFT_TOKENS", np.int32))


def _get(request, name):
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy()


class TritonPythonModel:
    def initialize(self, args):
        params = {k: v["string_value"] for k, v in json.loads(args["model_config"])["parameters"].items()}
        self.codec = TextCodec(params["tokenizer_dir"], params.get("skip_special_tokens", "true") == "true")

    def execute(self, requests):
        return [self._one(r) for r in requests]

    def _one(self, request):
        tokens = _get(request, "TOKENS_BATCH")  # [1, beam=1, n]
        n = int(_get(request, "SEQUENCE_LENGTH").reshape(-1)[0])
        new = tokens.reshape(-1)[:n].tolist()
        preceding = _get(request, "PRECEDING_TOKENS")
        text = self.codec.decode_delta([] if preceding is None else preceding.reshape(-1).tolist(), new)
        # one string per beam, 1-D as TensorRT-LLM's postprocessing returns it (clients read text_output[0])
        outputs = [pb_utils.Tensor("OUTPUT", np.array([text.encode()], dtype=object)),
                   pb_utils.Tensor("OUT_OUTPUT_IDS", np.asarray(new, dtype=np.int32).reshape(1, 1, -1))]
        for name, dtype in PASSTHROUGH:
            x = _get(request, name)
            outputs.append(pb_utils.Tensor(f"OUT_{name}", np.zeros((1, 1), dtype) if x is None else x.astype(dtype)))
        return pb_utils.InferenceResponse(outputs)
