"""Triton adapter: TensorRT-LLM's preprocessing model (text -> ids); the logic is trt_redrafter.serving.text."""

import json
import os
import sys

import numpy as np
import triton_python_backend_utils as pb_utils

# make-repo copies the text modules of trt_redrafter beside this file, so a stock tritonserver loads this model
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from trt_redrafter.errors import UserError
from trt_redrafter.serving.text import TextCodec, pad_rows


ENSEMBLE_NAMES = {"QUERY": "text_input", "DECODER_QUERY": "decoder_text_input", "STOP_WORDS_DICT": "stop_words",
                  "BAD_WORDS_DICT": "bad_words", "EMBEDDING_BIAS_WORDS": "embedding_bias_words",
                  "REQUEST_OUTPUT_LEN": "max_tokens"}


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


def _rows(request, name, default, dtype, b):
    """An optional [B, 1] input (or its default) as [B, 1] of dtype; one value stands for every row."""
    t = pb_utils.get_input_tensor_by_name(request, name)
    x = np.full(b, default) if t is None else t.as_numpy().reshape(-1)
    if x.size == 1:
        x = np.repeat(x, b)
    if x.size != b:
        raise UserError(f"input '{ENSEMBLE_NAMES.get(name, name.lower())}' has {x.size} values for {b} prompts; send "
                        f"one per prompt.")
    return x.astype(dtype).reshape(b, 1)


def _word_lists(lists):
    """Each prompt's [2, n] word list -> [B, 2, max n]: ids padded with 0, offsets with -1 (TensorRT-LLM's)."""
    return np.stack([pad_rows([x[0] for x in lists], 0), pad_rows([x[1] for x in lists], -1)], axis=1)


def _words_by_row(tensor, b):
    """stop_words/bad_words: [B, n] strings (one row per prompt, n words each, '' pads), or one row for all."""
    shape = tensor.as_numpy().shape
    strings = _strings(tensor)  # decoded, and checked for UTF-8, in row-major order
    rows = shape[0] if len(shape) > 1 else 1
    n = len(strings) // max(rows, 1)
    per_row = [strings[i * n:(i + 1) * n] for i in range(rows)]
    if rows == 1:
        return per_row * b
    if rows != b:
        raise UserError(f"input '{ENSEMBLE_NAMES[tensor.name()]}' has {rows} rows for {b} prompts; send one row of "
                        f"words per prompt.")
    return per_row


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
            texts = _strings(query)  # one per prompt: a batch is B rows of one string each
            b = query.as_numpy().shape[0] if query.as_numpy().ndim else 1
            if len(texts) != b:
                raise UserError(f"send one text_input per prompt (shape [batch, 1]), got shape "
                                f"{list(query.as_numpy().shape)}.")
            for i, text in enumerate(texts or [""]):
                if not text:
                    raise UserError("text_input is empty; send a non-empty prompt." if b == 1 else
                                    f"text_input {i} of the batch is empty; send a non-empty prompt.")
            chat = _rows(request, "APPLY_CHAT_TEMPLATE", False, bool, b).reshape(-1)
            output_len = pb_utils.get_input_tensor_by_name(request, "REQUEST_OUTPUT_LEN")
            if output_len is None:
                raise UserError("max_tokens (preprocessing's REQUEST_OUTPUT_LEN) is missing.")
            output_len = _rows(request, "REQUEST_OUTPUT_LEN", 0, np.int32, b)
            _refuse_unsupported(request)
            end, pad = _rows(request, "END_ID", self.codec.end_id, np.int32, b), \
                _rows(request, "PAD_ID", self.codec.pad_id, np.int32, b)
            prompts = [self.codec.encode(text, chat=bool(c)) for text, c in zip(texts, chat)]
            lengths = np.array([[len(p)] for p in prompts], dtype=np.int32)
            # rows padded to the longest with each row's pad id; input_lengths tells the engine where each ends
            ids = pad_rows(prompts, pad)
            words = {}
            for name, out in (("BAD_WORDS_DICT", "BAD_WORDS_IDS"), ("STOP_WORDS_DICT", "STOP_WORDS_IDS")):
                t = pb_utils.get_input_tensor_by_name(request, name)
                per_row = [[]] * b if t is None else _words_by_row(t, b)
                words[out] = _word_lists([self.codec.words_to_list(w) for w in per_row])
        except UserError as e:
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG))
        return pb_utils.InferenceResponse([
            pb_utils.Tensor("INPUT_ID", ids),
            pb_utils.Tensor("REQUEST_INPUT_LEN", lengths),
            pb_utils.Tensor("REQUEST_OUTPUT_LEN", output_len),
            # a decoder-only model: one pad token as the decoder input, as TensorRT-LLM's preprocessing sends
            pb_utils.Tensor("DECODER_INPUT_ID", pad.copy()),
            pb_utils.Tensor("REQUEST_DECODER_INPUT_LEN", np.ones((b, 1), dtype=np.int32)),
            pb_utils.Tensor("EMBEDDING_BIAS", np.empty((b, 0), dtype=np.float32)),
            pb_utils.Tensor("BAD_WORDS_IDS", words["BAD_WORDS_IDS"]),
            pb_utils.Tensor("STOP_WORDS_IDS", words["STOP_WORDS_IDS"]),
            pb_utils.Tensor("OUT_END_ID", end),
            pb_utils.Tensor("OUT_PAD_ID", pad),
            pb_utils.Tensor("OUT_RETURN_PERF_METRICS", _rows(request, "RETURN_PERF_METRICS", True, bool, b)),
        ])
