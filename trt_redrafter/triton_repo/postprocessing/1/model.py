"""Triton adapter: TensorRT-LLM's postprocessing model (ids -> text); the logic is trt_redrafter.serving.text.

It also carries a client's cancellation of an ensemble request to the engine. Triton 2.51's ensemble scheduler does
not cancel a composing request that is already running (the engine's stream); it marks the steps it schedules
afterwards as cancelled, i.e. this model's requests for the engine's next responses. So a cancelled request here
sends its REQUEST_KEY (the engine model's `request_key` output) back to the engine as `cancel_request_key`, once.
"""

import json
import os
import sys
from collections import OrderedDict

import numpy as np
import triton_python_backend_utils as pb_utils

# make-repo copies the text modules of trt_redrafter beside this file, so a stock tritonserver loads this model
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from trt_redrafter.serving.text import TextCodec, pad_rows

PASSTHROUGH = (("ACCEPTANCE_RATE", np.float32), ("TOTAL_ACCEPTED_DRAFT_TOKENS", np.int32),
               ("TOTAL_DRAFT_TOKENS", np.int32))


def _get(request, name):
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy()


class TritonPythonModel:
    def initialize(self, args):
        params = {k: v["string_value"] for k, v in json.loads(args["model_config"])["parameters"].items()}
        self.codec = TextCodec(params["tokenizer_dir"], params.get("skip_special_tokens", "true") == "true")
        self.engine_model = params.get("engine_model", "tensorrt_llm")
        self.engine_decoupled = params.get("engine_decoupled", "true") == "true"
        self.cancelled_keys = OrderedDict()  # keys already sent to the engine, oldest first (bounded)

    def execute(self, requests):
        for r in requests:
            if r.is_cancelled():
                self._cancel_in_engine(r)
        # a cancelled request is still answered as usual: answering it with an error leaves the ensemble request in
        # flight for ever once the engine ends the stream (tritonserver then times out at exit with it)
        return [self._one(r) for r in requests]

    def _cancel_in_engine(self, request):
        key = _get(request, "REQUEST_KEY")
        if key is None:  # the tensorrtllm engine sends no key (its backend handles its own requests)
            return
        key = int(key.reshape(-1)[0])
        if key in self.cancelled_keys:  # every later chunk of the stream arrives cancelled too
            return
        self.cancelled_keys[key] = None
        while len(self.cancelled_keys) > 4096:
            self.cancelled_keys.popitem(last=False)
        inputs = [pb_utils.Tensor("input_ids", np.zeros((1, 1), np.int32)),
                  pb_utils.Tensor("input_lengths", np.ones((1, 1), np.int32)),
                  pb_utils.Tensor("request_output_len", np.ones((1, 1), np.int32)),
                  pb_utils.Tensor("cancel_request_key", np.array([[key]], np.uint64))]
        try:
            result = pb_utils.InferenceRequest(model_name=self.engine_model, inputs=inputs,
                                               requested_output_names=[]).exec(decoupled=self.engine_decoupled)
            for response in (result if self.engine_decoupled else [result]):
                if response.has_error():
                    raise RuntimeError(response.error().message())
        except Exception as e:  # the client is gone either way; the engine then finishes the request unasked
            pb_utils.Logger.log_warn(f"postprocessing: cancelling engine request {key} failed: {e}")

    def _one(self, request):
        tokens = _get(request, "TOKENS_BATCH")
        length = _get(request, "SEQUENCE_LENGTH")
        missing = [name for name, x in (("TOKENS_BATCH", tokens), ("SEQUENCE_LENGTH", length)) if x is None]
        if missing:  # declared optional so that Triton hands the request over to be answered (config.pbtxt)
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(
                f"postprocessing: input {', '.join(repr(m) for m in missing)} is missing; send the engine's "
                f"output_ids and sequence_length.", pb_utils.TritonError.INVALID_ARG))
        # [B, beam=1, n] and [B, beam=1]: one row per prompt (the engine answers a batch row by row, so B is 1
        # in the ensemble; a client calling this model directly may send more)
        b = tokens.shape[0] if tokens.ndim == 3 else 1
        if length.size != b:
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(
                f"postprocessing: sequence_length has {length.size} values for {b} rows of output_ids; send one "
                f"per row.", pb_utils.TritonError.INVALID_ARG))
        tokens, length = tokens.reshape(b, -1), length.reshape(b)
        preceding = _get(request, "PRECEDING_TOKENS")
        preceding = None if preceding is None else preceding.reshape(b, -1)
        texts, rows = [], []
        for i in range(b):
            new = tokens[i, :int(length[i])].tolist()
            texts.append(self.codec.decode_delta([] if preceding is None else preceding[i].tolist(), new).encode())
            rows.append(new)
        ids = pad_rows(rows, 0)[:, None, :]  # [B, beam=1, longest]
        # one string per row (beam width 1), 1-D as TensorRT-LLM's postprocessing returns it (clients read
        # text_output[0])
        outputs = [pb_utils.Tensor("OUTPUT", np.array(texts, dtype=object)),
                   pb_utils.Tensor("OUT_OUTPUT_IDS", ids)]
        for name, dtype in PASSTHROUGH:
            x = _get(request, name)
            outputs.append(pb_utils.Tensor(f"OUT_{name}", np.zeros((b, 1), dtype) if x is None else x.astype(dtype)))
        return pb_utils.InferenceResponse(outputs)
