"""The stock TensorRT-LLM Triton contract: every input and output of tensorrtllm_backend's `ensemble`,
`preprocessing`, `postprocessing`, `tensorrt_llm` and `tensorrt_llm_bls` models, as (name, data type, dims, optional).

Read from `all_models/inflight_batcher_llm/*/config.pbtxt` at tensorrtllm_backend v0.19.0 (c1e1963), the last release
with `all_models/` at the top level, and at c2e65b8 (the last tree on main before it moved into TensorRT-LLM's
`triton_backend/`); the two differ only in names: v0.19.0's `random_seed` / `min_length` are c2e65b8's `seed` /
`min_tokens`, so both are listed. `return_num_input_tokens` / `return_num_output_tokens` and their outputs come from
the moved copy (NVIDIA/TensorRT-LLM triton_backend, ensemble @ 2a9abd9, tensorrt_llm @ 0c8de69). Multimodal and
encoder-decoder preprocessing tensors are left out (a decoder-only text engine has nothing to put there).

`tests/test_triton_contract.py` checks that the repository `make-repo` writes declares each of them with the same
type, dims and optionality (ours may add optional inputs and extra outputs), so a client written for the stock
models is never refused by Triton for a tensor name. What the engine does with each input is
`serving.engine_model.parse_inputs`: honoured, or refused with one sentence when a request asks for what it
cannot do.
"""

from __future__ import annotations

from typing import NamedTuple


class Tensor(NamedTuple):
    name: str
    dtype: str
    dims: tuple[int, ...]
    optional: bool = True


def _t(name: str, dtype: str, dims=(1,), optional: bool = True) -> Tensor:
    return Tensor(name, "TYPE_" + dtype, tuple(dims), optional)


_SAMPLING = [_t("top_k", "INT32"), _t("top_p", "FP32"), _t("temperature", "FP32"), _t("length_penalty", "FP32"),
             _t("repetition_penalty", "FP32"), _t("min_length", "INT32"), _t("min_tokens", "INT32"),
             _t("presence_penalty", "FP32"), _t("frequency_penalty", "FP32"), _t("random_seed", "UINT64"),
             _t("seed", "UINT64")]
_RETURNS = [_t("return_log_probs", "BOOL"), _t("return_context_logits", "BOOL"),
            _t("return_generation_logits", "BOOL"), _t("return_perf_metrics", "BOOL"),
            _t("return_num_input_tokens", "BOOL"), _t("return_num_output_tokens", "BOOL")]
_LORA = [_t("lora_task_id", "UINT64"), _t("lora_weights", "FP16", (-1, -1)), _t("lora_config", "INT32", (-1, 3))]
_GUIDED = [_t("guided_decoding_guide_type", "STRING"), _t("guided_decoding_guide", "STRING")]
_PERF_OUTPUTS = [_t("kv_cache_alloc_new_blocks", "INT32"), _t("kv_cache_reused_blocks", "INT32"),
                 _t("kv_cache_alloc_total_blocks", "INT32"), _t("arrival_time_ns", "INT64"),
                 _t("first_scheduled_time_ns", "INT64"), _t("first_token_time_ns", "INT64"),
                 _t("last_token_time_ns", "INT64"), _t("acceptance_rate", "FP32"),
                 _t("total_accepted_draft_tokens", "INT32"), _t("total_draft_tokens", "INT32")]
_COMMON_OUTPUTS = [_t("cum_log_probs", "FP32", (-1,)), _t("output_log_probs", "FP32", (-1, -1)),
                   _t("context_logits", "FP32", (-1, -1)), _t("generation_logits", "FP32", (-1, -1, -1)),
                   _t("batch_index", "INT32"), _t("sequence_index", "INT32"), *_PERF_OUTPUTS,
                   _t("num_input_tokens", "INT32"), _t("num_output_tokens", "INT32")]

ENSEMBLE_INPUTS = [
    _t("text_input", "STRING", optional=False), _t("decoder_text_input", "STRING"),
    _t("max_tokens", "INT32", optional=False), _t("num_return_sequences", "INT32"),
    _t("bad_words", "STRING", (-1,)), _t("stop_words", "STRING", (-1,)), _t("exclude_input_in_output", "BOOL"),
    _t("end_id", "INT32"), _t("pad_id", "INT32"), *_SAMPLING, *_RETURNS, _t("beam_width", "INT32"),
    _t("stream", "BOOL"), _t("prompt_embedding_table", "FP16", (-1, -1)), _t("prompt_table_extra_id", "UINT64"),
    _t("prompt_vocab_size", "INT32"), _t("embedding_bias_words", "STRING", (-1,)),
    _t("embedding_bias_weights", "FP32", (-1,)), *_LORA, *_GUIDED,
]
ENSEMBLE_OUTPUTS = [_t("text_output", "STRING", (-1,)), *_COMMON_OUTPUTS]

PREPROCESSING_INPUTS = [
    _t("QUERY", "STRING", optional=False), _t("DECODER_QUERY", "STRING"),
    _t("REQUEST_OUTPUT_LEN", "INT32", optional=False), _t("BAD_WORDS_DICT", "STRING", (-1,)),
    _t("STOP_WORDS_DICT", "STRING", (-1,)), _t("EMBEDDING_BIAS_WORDS", "STRING", (-1,)),
    _t("EMBEDDING_BIAS_WEIGHTS", "FP32", (-1,)), _t("END_ID", "INT32"), _t("PAD_ID", "INT32"),
    _t("PROMPT_TABLE_EXTRA_ID", "UINT64"),
]
PREPROCESSING_OUTPUTS = [
    _t("INPUT_ID", "INT32", (-1,)), _t("REQUEST_INPUT_LEN", "INT32"), _t("DECODER_INPUT_ID", "INT32", (-1,)),
    _t("REQUEST_DECODER_INPUT_LEN", "INT32"), _t("BAD_WORDS_IDS", "INT32", (2, -1)),
    _t("STOP_WORDS_IDS", "INT32", (2, -1)), _t("EMBEDDING_BIAS", "FP32", (-1,)),
    _t("REQUEST_OUTPUT_LEN", "INT32", (-1,)), _t("OUT_END_ID", "INT32"), _t("OUT_PAD_ID", "INT32"),
    _t("OUT_PROMPT_TABLE_EXTRA_IDS", "UINT64", (-1,)),
]

POSTPROCESSING_INPUTS = [_t("TOKENS_BATCH", "INT32", (-1, -1), optional=False),
                         _t("SEQUENCE_LENGTH", "INT32", (-1,), optional=False)]
POSTPROCESSING_OUTPUTS = [_t("OUTPUT", "STRING", (-1,))]

ENGINE_INPUTS = [
    _t("input_ids", "INT32", (-1,)), _t("encoder_input_features", "FP16", (-1, -1)),
    _t("encoder_output_lengths", "INT32"), _t("input_lengths", "INT32", optional=False),
    _t("request_output_len", "INT32", optional=False), _t("num_return_sequences", "INT32"),
    _t("draft_input_ids", "INT32", (-1,)), _t("decoder_input_ids", "INT32", (-1,)),
    _t("decoder_input_lengths", "INT32"), _t("draft_logits", "FP32", (-1, -1)),
    _t("draft_acceptance_threshold", "FP32"), _t("end_id", "INT32"), _t("pad_id", "INT32"),
    _t("stop_words_list", "INT32", (2, -1)), _t("bad_words_list", "INT32", (2, -1)),
    _t("embedding_bias", "FP32", (-1,)), _t("beam_width", "INT32"), _t("temperature", "FP32"),
    _t("runtime_top_k", "INT32"), _t("runtime_top_p", "FP32"), _t("runtime_top_p_min", "FP32"),
    _t("runtime_top_p_decay", "FP32"), _t("runtime_top_p_reset_ids", "INT32"), _t("len_penalty", "FP32"),
    _t("early_stopping", "BOOL"), _t("repetition_penalty", "FP32"), _t("min_length", "INT32"),
    _t("min_tokens", "INT32"), _t("beam_search_diversity_rate", "FP32"), _t("presence_penalty", "FP32"),
    _t("frequency_penalty", "FP32"), _t("no_repeat_ngram_size", "INT32"), _t("random_seed", "UINT64"),
    _t("seed", "UINT64"), *_RETURNS, _t("exclude_input_in_output", "BOOL"), _t("stop", "BOOL"),
    _t("streaming", "BOOL"), _t("prompt_embedding_table", "FP16", (-1, -1)),
    _t("prompt_table_extra_ids", "UINT64", (-1,)), _t("prompt_vocab_size", "INT32"),
    _t("cross_attention_mask", "BOOL", (-1, -1)), _t("mrope_rotary_cos_sin", "FP32", (-1,)),
    _t("mrope_position_deltas", "INT64"), *_LORA, _t("context_phase_params", "UINT8", (-1,)),
    _t("skip_cross_attn_blocks", "BOOL"), _t("retention_token_range_starts", "INT32", (-1,)),
    _t("retention_token_range_ends", "INT32", (-1,)), _t("retention_token_range_priorities", "INT32", (-1,)),
    _t("retention_token_range_durations_ms", "INT32", (-1,)), _t("retention_decode_priority", "INT32"),
    _t("retention_decode_duration_ms", "INT32"), *_GUIDED, _t("lookahead_window_size", "INT32"),
    _t("lookahead_ngram_size", "INT32"), _t("lookahead_verification_set_size", "INT32"),
]
ENGINE_OUTPUTS = [_t("output_ids", "INT32", (-1, -1)), _t("sequence_length", "INT32", (-1,)),
                  *_COMMON_OUTPUTS, _t("context_phase_params", "UINT8", (-1,))]

# tensorrt_llm_bls: the ensemble's text interface as one Python model (tensorrt_llm_bls/config.pbtxt), plus the
# draft-model inputs of its speculative mode; its image inputs are left out with the other multimodal tensors
BLS_INPUTS = [t for t in ENSEMBLE_INPUTS if t.name not in ("prompt_table_extra_id",)] + [
    _t("prompt_table_extra_id", "UINT64"), _t("num_draft_tokens", "INT32"), _t("use_draft_logits", "BOOL")]
BLS_OUTPUTS = [t for t in ENSEMBLE_OUTPUTS]

STOCK = {"ensemble": (ENSEMBLE_INPUTS, ENSEMBLE_OUTPUTS), "tensorrt_llm_bls": (BLS_INPUTS, BLS_OUTPUTS),
         "preprocessing": (PREPROCESSING_INPUTS, PREPROCESSING_OUTPUTS),
         "postprocessing": (POSTPROCESSING_INPUTS, POSTPROCESSING_OUTPUTS),
         "tensorrt_llm": (ENGINE_INPUTS, ENGINE_OUTPUTS)}


