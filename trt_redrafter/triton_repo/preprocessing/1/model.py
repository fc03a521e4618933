"""Triton adapter: TensorRT-LLM's preprocessing model (text -> ids); the logic is trt_redrafter.serving.text."""

import json
import os
import sys

import numpy as np
import triton_python_backend_utils as pb_utils

# make-repo copies the text modules of trt_redrafter beside this file, so a stock tritonserver loads this model
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from trt_redrafter.errors import UserError
from trt_redrafter.serving.text import TextCodec


ENSEMBLE_NAMES = {"QUERY": "text_input", "DECODER_QUERY": "decoder_text_input", "STOP_WORDS_DICT": "stop_words",
                  "BAD_WORDS_DICT": "bad_words", "EMBEDDING_BIAS_WORDS": "embedding_bias_words"}


def _strings(tensor):
    out = []
    for x in tensor.as_numpy().reshape(-1):
        try:
            out.append(x.decode() if isinstance(x, bytes) else str(x))
        except UnicodeDecodeError as e:
            name = ENSEMBLE_NAMES.get(tensor.name(), tensor.name())
            raise UserError(f"input '{name}' is not valid UTF-8 (byte {e.start}: {x[e.start:e.start + 1]!r}); "
                            f"send text encoded as UTF-8.") from None
    return out


def _id(request, name, default):
    t = pb_utils.get_input_tensor_by_name(request, name)
    return np.array([[default if t is None else int(t.as_numpy().reshape(-1)[0])]], dtype=np.int32)


def _flag(request, name, default):
    t = pb_utils.get_input_tensor_by_name(request, name)
    return np.array([[default if t is None else bool(t.as_numpy().reshape(-1)[0])]], dtype=bool)


def _refuse_unsupported(request):
    """The stock inputs a decoder-only text engine has no use for: refused when they carry anything."""
    decoder = pb_utils.get_input_tensor_by_name(request, "DECODER_QUERY")
    if decoder is not None and any(_strings(decoder)):
        raise UserError("decoder_text_input is for encoder-decoder models; this engine is decoder-only: leave it out.")
    if pb_utils.get_input_tensor_by_name(request, "PROMPT_TABLE_EXTRA_ID") is not None:
        raise UserError("prompt_table_extra_id asks for prompt tuning, which this engine does not support; leave it "
                        "out.")
    words = pb_utils.get_input_tensor_by_name(request, "EMBEDDING_BIAS_WORDS")
    weights = pb_utils.get_input_tensor_by_name(request, "EMBEDDING_BIAS_WEIGHTS")
    if (words is not None and any(_strings(words))) or (weights is not None and weights.as_numpy().size):
        raise UserError("embedding_bias_words/embedding_bias_weights ask for a logits bias, which this engine does "
                        "not apply; leave them out.")


class TritonPythonModel:
    def initialize(self, args):
        params = {k: v["string_value"] for k, v in json.loads(args["model_config"])["parameters"].items()}
        self.codec = TextCodec(params["tokenizer_dir"])

    def execute(self, requests):
        return [self._one(r) for r in requests]

    def _one(self, request):
        try:
            query = pb_utils.get_input_tensor_by_name(request, "QUERY")
            if query is None:  # declared optional so that Triton hands the request over to be answered (config.pbtxt)
                raise UserError("text_input (preprocessing's QUERY) is missing; send the prompt as text_input.")
            texts = _strings(query)
            if len(texts) != 1:
                raise UserError(f"send one text_input per request, got {len(texts)}.")
            if not texts[0]:
                raise UserError("text_input is empty; send a non-empty prompt.")
            chat = bool(_flag(request, "APPLY_CHAT_TEMPLATE", False).item())
            output_len = pb_utils.get_input_tensor_by_name(request, "REQUEST_OUTPUT_LEN")
            if output_len is None:
                raise UserError("max_tokens (preprocessing's REQUEST_OUTPUT_LEN) is missing.")
            _refuse_unsupported(request)
            ids = np.array([self.codec.encode(texts[0], chat=chat)], dtype=np.int32)
            words = {}
            for name, out in (("BAD_WORDS_DICT", "BAD_WORDS_IDS"), ("STOP_WORDS_DICT", "STOP_WORDS_IDS")):
                t = pb_utils.get_input_tensor_by_name(request, name)
                words[out] = self.codec.words_to_list(_strings(t) if t is not None else [])[None]
        except UserError as e:
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG))
        pad = _id(request, "PAD_ID", self.codec.pad_id)
        return pb_utils.InferenceResponse([
            pb_utils.Tensor("INPUT_ID", ids),
            pb_utils.Tensor("REQUEST_INPUT_LEN", np.array([[ids.shape[1]]], dtype=np.int32)),
            pb_utils.Tensor("REQUEST_OUTPUT_LEN", output_len.as_numpy().astype(np.int32).reshape(1, -1)),
            # a decoder-only model: one pad token as the decoder input, as TensorRT-LLM's preprocessing sends
            pb_utils.Tensor("DECODER_INPUT_ID", pad.copy()),
            pb_utils.Tensor("REQUEST_DECODER_INPUT_LEN", np.array([[1]], dtype=np.int32)),
            pb_utils.Tensor("EMBEDDING_BIAS", np.empty((1, 0), dtype=np.float32)),
            pb_utils.Tensor("BAD_WORDS_IDS", words["BAD_WORDS_IDS"]),
            pb_utils.Tensor("STOP_WORDS_IDS", words["STOP_WORDS_IDS"]),
            pb_utils.Tensor("OUT_END_ID", _id(request, "END_ID", self.codec.end_id)),
            pb_utils.Tensor("OUT_PAD_ID", pad),
            # default true: the ensemble's acceptance outputs are always filled (TensorRT-LLM's C++ backend sends
            # them only to requests that set return_perf_metrics)
            pb_utils.Tensor("OUT_RETURN_PERF_METRICS", _flag(request, "RETURN_PERF_METRICS", True)),
        ])
