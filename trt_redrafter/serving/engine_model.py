"""The torch engine behind Triton's `tensorrt_llm` model: Triton requests in, streamed responses out.

`trt_redrafter/triton_repo/tensorrt_llm/1/model.py` is a thin adapter: it turns each Triton request into a dict of
numpy inputs plus a `ResponseSink` and calls `EngineModel.submit`; everything else happens here, testable without
Triton. Flow:

    execute() -> submit()   parse the inputs, queue the request on the in-flight Scheduler, return at once
    scheduler thread        after every step, `_on_tokens` sends the request's new tokens (streaming) or,
                            once finished, all of them, the last response flagged final
    monitor thread          polls client cancellation (frees the request's KV blocks before the next step)
                            and refreshes the Prometheus gauges

Tensor names and semantics are TensorRT-LLM's `tensorrt_llm` model's (docs/serving.md, serving/contract.py):
`output_ids` holds the new tokens of a streaming response, or the whole output otherwise (after the prompt unless
exclude_input_in_output), `stop=true` with a request's id ends it early, every response carries
`acceptance_rate`, `total_accepted_draft_tokens` and `total_draft_tokens`, and each stock input is honoured or
refused in one sentence (`parse_inputs`). A request with a batch of prompts is split into one engine request per row
(`split_rows`), each answered with its `batch_index`. With tp > 1 this process is rank 0 and launches the
other ranks (`follower.py`) with mpirun.
"""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol

import numpy as np

from ..config import PROPOSERS, Guide, SamplingConfig
from ..errors import ServerBusy, UserError
from ..log import get_logger
from ..runtime.sequence import RequestSpec
from . import DRAIN_REQUEST_ID
from .text import list_to_words

logger = get_logger(__name__)

# `decoding_mode` values (an optional BYTES input, torch engine only): the same engine decodes a request with
# ReDrafter or auto-regressively, so a benchmark can compare both on one server with requests interleaved.
DECODING_MODES = {"redrafter": "redrafter", "ar": "ar", "auto_regressive": "ar"}
CANCEL_POLL_S = 0.02  # how often client cancellation is checked
METRICS_PERIOD_S = 0.1  # how often the scheduler gauges are refreshed
FOLLOWER_EXIT_TIMEOUT_S = 15.0


class ResponseSink(Protocol):
    """One request's response channel (Triton: the request's decoupled response sender)."""

    def send(self, outputs: Optional[dict[str, np.ndarray]], error: Optional[str], final: bool,
             code: str = "INVALID_ARG") -> None:
        """`code`, with an error: Triton's status for it (pb_utils.TritonError's names: INVALID_ARG, a request the
        client can fix, HTTP 400; UNAVAILABLE, busy, 503; CANCELLED; INTERNAL, a bug, 500)."""

    def is_cancelled(self) -> bool: ...


# TensorRT-LLM's `tensorrt_llm` inputs this engine cannot honour, accepted (so stock clients and the stock ensemble
# may send them) while they ask for nothing: {name: (what "asks for nothing" is, why it cannot be honoured)}.
# A request that sets one otherwise gets one error naming it. tensorrtllm_backend's config.pbtxt @ c1e1963 (v0.19.0,
# which calls the seed `random_seed` and min_tokens `min_length`) and @ c2e65b8 declare them all.
_NEUTRAL = {
    "repetition_penalty": (1.0, "penalties are not implemented by the torch engine"),
    "presence_penalty": (0.0, "penalties are not implemented by the torch engine"),
    "frequency_penalty": (0.0, "penalties are not implemented by the torch engine"),
    "no_repeat_ngram_size": (0, "no_repeat_ngram_size is not implemented by the torch engine"),
    "min_length": (1, "a minimum output length is not implemented (send end_id=-1 to get exactly max_tokens)"),
    "min_tokens": (1, "a minimum output length is not implemented (send end_id=-1 to get exactly max_tokens)"),
    "num_return_sequences": (1, "one sequence per request is returned (send several requests)"),
    "return_context_logits": (False, "context logits are not returned by the torch engine"),
    "return_generation_logits": (False, "generation logits are not returned by the torch engine"),
    "runtime_top_p_min": (0.0, "top-p decay is not implemented"),
    "runtime_top_p_decay": (0.0, "top-p decay is not implemented"),
    "runtime_top_p_reset_ids": (-1, "top-p decay is not implemented"),
}
# beam-search-only knobs: with one beam (the only width served) TensorRT-LLM does not use them either
_BEAM_ONLY = ("len_penalty", "early_stopping", "beam_search_diversity_rate")
# inputs for features this engine does not have: refused whenever they carry data
_UNSUPPORTED = {
    "embedding_bias": "a logits bias (embedding_bias_words/weights)",
    "encoder_input_features": "encoder inputs (this is a decoder-only engine)",
    "encoder_output_lengths": "encoder inputs (this is a decoder-only engine)",
    "draft_input_ids": "external draft tokens (ReDrafter drafts its own)",
    "draft_logits": "external draft logits (ReDrafter drafts its own)",
    "draft_acceptance_threshold": "external draft tokens (ReDrafter drafts its own)",
    "prompt_embedding_table": "prompt tuning", "prompt_vocab_size": "prompt tuning",
    "prompt_table_extra_ids": "prompt-table extra ids",
    "cross_attention_mask": "cross attention", "skip_cross_attn_blocks": "cross attention",
    "mrope_rotary_cos_sin": "multimodal RoPE", "mrope_position_deltas": "multimodal RoPE",
    "lora_task_id": "LoRA adapters", "lora_weights": "LoRA adapters", "lora_config": "LoRA adapters",
    "context_phase_params": "disaggregated serving",
    "retention_token_range_starts": "KV-cache retention", "retention_token_range_ends": "KV-cache retention",
    "retention_token_range_priorities": "KV-cache retention",
    "retention_token_range_durations_ms": "KV-cache retention", "retention_decode_priority": "KV-cache retention",
    "retention_decode_duration_ms": "KV-cache retention",
    "lookahead_window_size": "lookahead decoding", "lookahead_ngram_size": "lookahead decoding",
    "lookahead_verification_set_size": "lookahead decoding",
}


@dataclass
class ParsedRequest:
    """One prompt's inputs: what it asks the engine for (`spec`: the `decoding_mode` and `proposer` inputs
    included), and how its responses are shaped."""

    spec: RequestSpec
    streaming: bool
    # the prompt ahead of the output in a non-streaming response (TensorRT-LLM: not exclude_input_in_output)
    include_input: bool = False
    perf_metrics: bool = False  # return_perf_metrics: KV-cache and timing outputs too
    count_input: bool = False  # return_num_input_tokens
    count_output: bool = False  # return_num_output_tokens


@dataclass
class _Open:
    """A request in flight: what it asked for, where its responses go and what was sent already."""

    triton_id: str  # the client's id (Triton's request id), echoed in logs and matched by stop requests
    sink: ResponseSink
    request: ParsedRequest
    streaming: bool  # the Triton request's (row 0's, for a batch)
    arrival_ns: int = field(default_factory=time.time_ns)
    first_token_ns: Optional[int] = None
    last_token_ns: Optional[int] = None
    sent: list[int] = field(default_factory=list)
    generation_steps: int = 0
    key: int = 0  # this model's id of the request: the scheduler's request id, the `request_key` output and the
    # `cancel_request_key` input
    # a Triton request with a batch of prompts is one _Open per row, sharing the sink, the lock and `rows`
    batch_index: Optional[int] = None  # the row (the `batch_index` output), None for a request of one prompt
    rows: Optional["_Rows"] = None
    # Triton frees a response sender once its final response is sent, and `is_cancelled()` on it afterwards
    # crashes tritonserver (SIGSEGV in TRITONBACKEND_ResponseFactoryIsCancelled, seen under load): the final
    # send and the monitor's cancellation poll are serialized by this lock, and `closed` ends the polling.
    lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False


class _Rows:
    """The rows of one batched Triton request still running: only the last to finish sends the final flag."""

    def __init__(self, n: int):
        self.pending = n

    def finish(self) -> bool:
        """One row finished (under the rows' shared lock); True for the last."""
        self.pending -= 1
        return self.pending == 0


def split_rows(inputs: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """A request with a batch of B prompts (input_ids [B, L], every other input [B, ...], as Triton's batching
    delivers them) -> B one-prompt requests, each row's input_ids cut to its input_lengths, as TensorRT-LLM's
    backend splits them (`splitBatchInputsTensors`, inflight_batcher_llm/src/utils.cc @ c1e1963, v0.19.0).
    `streaming` and `stop` are the request's, not a row's: row 0's value holds for all."""
    ids = inputs.get("input_ids")
    if ids is None or ids.ndim != 2 or ids.shape[0] <= 1:
        return [inputs]
    b = ids.shape[0]
    lengths = inputs.get("input_lengths")
    if lengths is None or lengths.size != b:
        raise UserError(f"input_ids holds a batch of {b} prompts: send input_lengths with one length per prompt "
                        f"(shape [{b}, 1]); each row of input_ids is padded to the longest.")
    for name, x in inputs.items():
        if x.ndim == 0 or x.shape[0] != b:
            raise UserError(f"input '{name}' has shape {list(x.shape)}, but input_ids holds a batch of {b} prompts; "
                            f"send one row per prompt.")
    rows = [{name: x[i:i + 1] for name, x in inputs.items()} for i in range(b)]
    for row in rows:
        for name in ("streaming", "stop"):
            if name in inputs:
                row[name] = inputs[name][:1]
    return rows


def _scalar(inputs: dict[str, np.ndarray], name: str, default=None):
    x = inputs.get(name)
    if x is None:
        return default
    if x.size != 1:
        raise UserError(f"input '{name}' must hold one value per request, got shape {list(x.shape)}.")
    v = x.reshape(-1)[0].item()
    if isinstance(v, float) and not math.isfinite(v):
        raise UserError(f"input '{name}' must be a finite number, got {v}.")
    return v


def is_stop_request(inputs: dict[str, np.ndarray]) -> bool:
    return bool(_scalar(inputs, "stop", False))


def parse_inputs(inputs: dict[str, np.ndarray], exclude_input_in_output: bool = True) -> ParsedRequest:
    """TensorRT-LLM `tensorrt_llm` inputs (with Triton's batch dimension of 1) -> a request; UserError if bad.
    The engine's own limits (max_input_len, max_seq_len, vocabulary) are checked by `Scheduler.submit`.
    `exclude_input_in_output`: the model's parameter of that name, which the request's input overrides."""
    for name, (neutral, why) in _NEUTRAL.items():
        v = _scalar(inputs, name)
        if v is not None and v != neutral:
            raise UserError(f"{name}={v} cannot be honoured: {why}; leave it out or send {neutral}.")
    for name in _BEAM_ONLY:
        _scalar(inputs, name)  # one value, or an error; no effect at beam width 1 (TensorRT-LLM's too)
    for name, what in _UNSUPPORTED.items():
        x = inputs.get(name)
        if x is not None and x.size and not (name == "embedding_bias" and not np.any(x)):
            raise UserError(f"input '{name}': this engine does not support {what}; leave it out.")
    dec = inputs.get("decoder_input_ids")  # what stock preprocessing sends a decoder-only model: one pad token
    if dec is not None and dec.size > 1:
        raise UserError("input 'decoder_input_ids': this is a decoder-only engine; send the prompt as input_ids.")
    ids = inputs.get("input_ids")
    if ids is None:
        raise UserError("input 'input_ids' is missing.")
    if ids.ndim == 2 and ids.shape[0] != 1:
        raise UserError(f"send one prompt per request; 'input_ids' has a batch of {ids.shape[0]}.")
    prompt = ids.reshape(-1).astype(np.int64).tolist()
    n = _scalar(inputs, "input_lengths")
    if n is not None:
        if not 0 <= n <= len(prompt):
            raise UserError(f"input_lengths={n} but input_ids holds {len(prompt)} tokens.")
        prompt = prompt[:n]
    if not prompt:
        raise UserError("the prompt is empty; send at least one token (a non-empty text_input).")
    max_tokens = _scalar(inputs, "request_output_len")
    if max_tokens is None:
        raise UserError("input 'request_output_len' (the ensemble's 'max_tokens') is missing.")
    if max_tokens <= 0:
        raise UserError(f"max_tokens must be a positive integer, got {max_tokens}.")
    beam_width = _scalar(inputs, "beam_width", 1)
    if beam_width != 1:
        raise UserError(f"beam_width={beam_width} is not supported: ReDrafter decodes one output beam (use 1).")
    temperature = float(_scalar(inputs, "temperature", 0.0))
    try:
        params = SamplingConfig(max_tokens=int(max_tokens), temperature=temperature,
                                top_k=int(_scalar(inputs, "runtime_top_k", 0)),
                                top_p=float(_scalar(inputs, "runtime_top_p", 1.0)) or 1.0,
                                seed=int(_scalar(inputs, "seed", _scalar(inputs, "random_seed", 0))),
                                logprobs=bool(_scalar(inputs, "return_log_probs", False)),
                                top_logprobs=int(_scalar(inputs, "top_logprobs", 0)))
        params.validate()
    except UserError as e:
        raise UserError(f"bad sampling parameters: {e}") from e
    end_id = _scalar(inputs, "end_id")
    stop_ids = () if end_id is None or end_id < 0 else (int(end_id),)
    stop_sequences = ()
    for name in ("stop_words_list", "bad_words_list"):
        x = inputs.get(name)
        if x is not None and (x.ndim < 2 or x.shape[-2] != 2 or x.size != 2 * x.shape[-1]):
            raise UserError(f"{name} must be [1, 2, n] (token ids, then end offsets padded with -1; TensorRT-LLM's "
                            f"word-list layout), got shape {list(x.shape)}.")
    if inputs.get("stop_words_list") is not None:
        stop_sequences = list_to_words(inputs["stop_words_list"].reshape(2, -1))
    if inputs.get("bad_words_list") is not None and list_to_words(inputs["bad_words_list"].reshape(2, -1)):
        raise UserError("bad_words cannot be honoured: the torch engine does not ban tokens; leave them out.")
    mode = _string(inputs, "decoding_mode") or "redrafter"
    if mode not in DECODING_MODES:
        raise UserError(f"decoding_mode must be one of {', '.join(DECODING_MODES)}, got {mode!r}.")
    proposer = _string(inputs, "proposer")
    if proposer and proposer not in PROPOSERS:
        raise UserError(f"proposer must be one of {', '.join(PROPOSERS)}, got {proposer!r}.")
    streaming = bool(_scalar(inputs, "streaming", False))
    exclude = bool(_scalar(inputs, "exclude_input_in_output", exclude_input_in_output))
    spec = RequestSpec(prompt, params, DECODING_MODES[mode], proposer or None, stop_ids, tuple(stop_sequences),
                       _string(inputs, "cache_salt", fold=False), _guide(inputs))
    return ParsedRequest(spec, streaming,
                         include_input=not exclude and not streaming,  # streamed responses never carry the prompt
                         perf_metrics=bool(_scalar(inputs, "return_perf_metrics", False)),
                         count_input=bool(_scalar(inputs, "return_num_input_tokens", False)),
                         count_output=bool(_scalar(inputs, "return_num_output_tokens", False)))


def _guide(inputs: dict[str, np.ndarray]) -> Optional[Guide]:
    """TensorRT-LLM's guided decoding inputs (`guided_decoding_guide_type`, `guided_decoding_guide`) -> the request's
    grammar, or None; the engine compiles it when the request is submitted."""
    kind, source = _string(inputs, "guided_decoding_guide_type"), _string(inputs, "guided_decoding_guide", fold=False)
    if not kind:
        if source:
            raise UserError("input 'guided_decoding_guide' needs 'guided_decoding_guide_type' too (json, json_schema, "
                            "regex, ebnf_grammar or structural_tag).")
        return None
    return Guide.parse(kind, source)


def _string(inputs: dict[str, np.ndarray], name: str, fold: bool = True) -> str:
    """An optional one-value BYTES input, decoded ('' when absent); `fold`: stripped and lower-cased (a keyword)."""
    x = inputs.get(name)
    if x is None:
        return ""
    if x.size != 1:
        raise UserError(f"input '{name}' must hold one value per request, got shape {list(x.shape)}.")
    v = x.reshape(-1)[0]  # BYTES arrive as an object array of bytes
    v = v.decode(errors="replace") if isinstance(v, bytes) else str(v)
    return v.strip().lower() if fold else v


def response_tensors(new: list[int], preceding: list[int], seq, state: Optional["_Open"] = None,
                     req=None) -> dict[str, np.ndarray]:
    """One response's tensors, with Triton's batch dimension: output_ids [1, beam=1, n] (the prompt first when the
    request includes it), sequence_length [1, beam=1]; the KV-cache and timing outputs with return_perf_metrics,
    num_input_tokens / num_output_tokens when asked (TensorRT-LLM's names and shapes)."""
    st = seq.stats
    ids = list(state.request.spec.prompt) + new if state is not None and state.request.include_input else new
    out = {
        "output_ids": np.asarray(ids, dtype=np.int32).reshape(1, 1, -1),
        "sequence_length": np.array([[len(ids)]], dtype=np.int32),
        "acceptance_rate": np.array([[st.acceptance_rate]], dtype=np.float32),
        "total_accepted_draft_tokens": np.array([[st.accepted_draft_tokens]], dtype=np.int32),
        "total_draft_tokens": np.array([[st.draft_tokens]], dtype=np.int32),
        "preceding_output_ids": np.asarray(preceding, dtype=np.int32).reshape(1, -1),
    }
    if state is None:
        return out
    out["request_key"] = np.array([[state.key]], dtype=np.uint64)
    if state.batch_index is not None:
        out["batch_index"] = np.array([[state.batch_index]], dtype=np.int32)
    if state.request.count_input:
        out["num_input_tokens"] = np.array([[len(state.request.spec.prompt)]], dtype=np.int32)
    if state.request.count_output:
        out["num_output_tokens"] = np.array([[len(preceding) + len(new)]], dtype=np.int32)
    if seq.sampling.wants_logprobs:
        out.update(logprob_tensors(seq.output_logprobs, len(preceding), len(new), seq.sampling.top_logprobs))
    if state.request.perf_metrics:
        blocks = req.kv_blocks if req is not None else 0
        reused = min(st.kv_reused_blocks, blocks)  # blocks taken from the prefix cache (runtime/kv_cache.py)
        scheduled = req.scheduled_ns if req is not None and req.scheduled_ns else state.arrival_ns
        out.update({
            "kv_cache_alloc_new_blocks": np.array([[blocks - reused]], dtype=np.int32),
            "kv_cache_reused_blocks": np.array([[reused]], dtype=np.int32),
            "kv_cache_alloc_total_blocks": np.array([[blocks]], dtype=np.int32),
            "arrival_time_ns": np.array([[state.arrival_ns]], dtype=np.int64),
            "first_scheduled_time_ns": np.array([[scheduled]], dtype=np.int64),
            "first_token_time_ns": np.array([[state.first_token_ns or 0]], dtype=np.int64),
            "last_token_time_ns": np.array([[state.last_token_ns or 0]], dtype=np.int64),
        })
    return out


def logprob_tensors(logprobs: list, start: int, n: int, top: int) -> dict[str, np.ndarray]:
    """The log-probabilities of a response that adds output tokens start..start+n, with Triton's batch dimension, as
    TensorRT-LLM's backend sends them: output_log_probs [1, beam=1, start + n], every output token's so far (a
    streamed response too, though its output_ids holds only the new tokens: TensorRT-LLM's `LlmRequest::createResult`
    slices the tokens and not their log-probabilities), and cum_log_probs [1, beam=1], their sum; with `top` > 0 this
    model's top_token_ids and top_log_probs [1, n, top], the most likely tokens at the new tokens' positions."""
    upto, part = logprobs[:start + n], logprobs[start:start + n]
    out = {"output_log_probs": np.array([t.logprob for t in upto], dtype=np.float32).reshape(1, 1, start + n),
           "cum_log_probs": np.array([[sum(t.logprob for t in upto)]], dtype=np.float32)}
    if top:
        out["top_token_ids"] = np.array([[i for i, _ in t.top] for t in part], dtype=np.int32).reshape(1, n, top)
        out["top_log_probs"] = np.array([[x for _, x in t.top] for t in part], dtype=np.float32).reshape(1, n, top)
    return out


def _utf8_locale() -> None:
    """Make text files open as UTF-8 in this process. A tritonserver Python-backend stub can start with the C locale
    (ASCII); torch.compile then fails reading its own templates (UnicodeDecodeError in inductor's load_template)."""
    import locale

    if locale.getpreferredencoding(False).lower().replace("-", "") != "utf8":
        try:
            locale.setlocale(locale.LC_CTYPE, "C.UTF-8")
        except locale.Error:
            logger.warning("no UTF-8 locale; torch.compile may fail to read its templates (use --compile off)")


class EngineModel:
    """Rank 0 of a served engine: the Engine, its Scheduler thread, and the Triton-facing request bookkeeping."""

    def __init__(self, engine_dir: str, tp_size: int, metrics_family: Optional[Callable] = None,
                 model_name: str = "tensorrt_llm", runtime_json: str = "", decoupled: bool = True,
                 max_queue_size: int = 0, exclude_input_in_output: bool = True):
        """decoupled: the model's transaction policy. Decoupled, a request may stream (many responses, the last
        flagged final); otherwise every request gets exactly one response (streaming is refused at once), which is
        what unary gRPC ModelInfer and HTTP infer need. max_queue_size: requests waiting beyond the running batch
        before new ones are refused as busy (0: no limit). exclude_input_in_output: the model's parameter (a request's
        input of that name overrides it): whether non-streaming responses leave the prompt out of output_ids."""
        from ..config import RuntimeConfig
        from ..runtime.distributed import free_port, init_dist_tcp
        from ..runtime.engine import Engine, freeze_heap
        from ..runtime.scheduler import Scheduler
        from .follower import launch_followers

        runtime = RuntimeConfig.from_dict(json.loads(runtime_json), where="runtime_config") if runtime_json \
            else RuntimeConfig()
        _utf8_locale()
        self.followers: Optional[subprocess.Popen] = None
        if tp_size > 1:
            port = free_port()
            self.followers = launch_followers(engine_dir, tp_size, port, runtime)
        self.dist = init_dist_tcp(0, tp_size, port if tp_size > 1 else 0, runtime.device)
        self.engine = Engine.load(engine_dir, self.dist, runtime)
        freeze_heap()  # the engine's objects, made once; the metrics below are released by collection (close)
        self.decoupled, self.exclude_input_in_output = decoupled, exclude_input_in_output
        self.scheduler = Scheduler(self.engine, max_queue_size=max_queue_size).start()
        self.metrics = None
        if metrics_family is not None:
            from .metrics import ServingMetrics

            self.metrics = ServingMetrics(metrics_family, {"model": model_name},
                                          self.engine.tree.draft_len_per_beam + 1)
        self._lock = threading.Lock()
        self._open: dict[int, _Open] = {}  # the request's key -> its state
        self._ids = itertools.count()
        self._closing = threading.Event()
        self._monitor = threading.Thread(target=self._monitor_loop, name="trt-redrafter-monitor", daemon=True)
        self._monitor.start()
        logger.info("serving %s (tp=%d, max_batch_size=%d, KV blocks=%d)", engine_dir, tp_size,
                    self.engine.build.max_batch_size, self.engine.cache.num_blocks)

    # ---- requests (Triton's execute thread) -----------------------------------------------------------------
    def submit(self, triton_id: str, inputs: dict[str, np.ndarray], sink: ResponseSink) -> None:
        from ..runtime.scheduler import Request

        cancel_key = inputs.get("cancel_request_key")
        if cancel_key is not None or is_stop_request(inputs):
            if cancel_key is not None:
                self.cancel_key(int(np.asarray(cancel_key).reshape(-1)[0]))
            else:
                self.stop_request(triton_id)
            sink.send(None if self.decoupled else {}, None, final=True)
            return
        try:
            rows = split_rows(inputs)
            if len(rows) > 1 and not self.decoupled:
                raise UserError(f"a request with a batch of {len(rows)} prompts needs a decoupled model (one response "
                                f"per prompt, each with its batch_index), and this repository's tensorrt_llm model is "
                                f"not decoupled; send one prompt per request, or make the repository with `make-repo "
                                f"--decoupled true`.")
            parsed = []
            for i, row in enumerate(rows):
                try:
                    parsed.append(parse_inputs(row, self.exclude_input_in_output))
                except UserError as e:
                    raise UserError(f"prompt {i} of the batch: {e}" if len(rows) > 1 else str(e)) from None
            if parsed[0].streaming and not self.decoupled:
                raise UserError("streaming needs a decoupled model, and this repository's tensorrt_llm model is not "
                                "decoupled; send streaming=false, or make the repository with `make-repo "
                                "--decoupled true`.")
            group = _Rows(len(rows)) if len(rows) > 1 else None
            lock = threading.Lock()  # one per Triton request: its rows share its response sender
            states, reqs = {}, []
            for i, p in enumerate(parsed):
                key = next(self._ids)
                states[key] = _Open(triton_id, sink, p, parsed[0].streaming, key=key, lock=lock,
                                    batch_index=i if group else None, rows=group)
                reqs.append(Request(key, p.spec, on_tokens=self._on_tokens))
            with self._lock:
                self._open.update(states)
            try:
                self.scheduler.submit_all(reqs)
            except BaseException:
                with self._lock:
                    for key in states:
                        self._open.pop(key, None)
                raise
        except UserError as e:
            if self.metrics:
                self.metrics.finished("busy" if isinstance(e, ServerBusy) else "rejected")
            sink.send(None, str(e), final=True, code="UNAVAILABLE" if isinstance(e, ServerBusy) else "INVALID_ARG")
        except Exception as e:  # a request the checks above did not foresee: still exactly one answer
            logger.exception("request %r could not be queued", triton_id)
            if self.metrics:
                self.metrics.finished("rejected")
            sink.send(None, f"the request could not be served ({type(e).__name__}: {e}); this is a bug in "
                            f"trt-redrafter's engine model, please report it with the request.", final=True,
                      code="INTERNAL")

    def stop_request(self, triton_id: str) -> int:
        """TensorRT-LLM's early stop: end every open request with this id (all of them for DRAIN_REQUEST_ID)."""
        return self._cancel_open(lambda s: triton_id in (s.triton_id, DRAIN_REQUEST_ID), f"stop request {triton_id!r}",
                                 stop=True)

    def cancel_key(self, key: int) -> int:
        """End the request this model keyed `key` (its `request_key` output). Postprocessing sends it when a client
        cancelled its ensemble request: Triton's ensemble then marks only the steps it schedules afterwards as
        cancelled (postprocessing sees them), never the engine step already running."""
        return self._cancel_open(lambda s: s.key == key, f"ensemble cancellation of request key {key}")

    def _cancel_open(self, match: Callable[[_Open], bool], why: str, stop: bool = False) -> int:
        """End the open requests `match` picks: cancelled (an error, or the bare final flag of a stream), or with
        `stop` stopped (a final response with the tokens generated so far: TensorRT-LLM's early stopping)."""
        with self._lock:
            ids = [key for key, s in self._open.items() if match(s)]
        for key in ids:
            self.scheduler.cancel(key, stop=stop)
        if ids:
            logger.info("%s ends %d request(s)", why, len(ids))
        return len(ids)

    # ---- responses (scheduler thread) -----------------------------------------------------------------------
    def _on_tokens(self, req, new: list[int], finished: bool) -> None:
        with self._lock:
            state = self._open.get(req.request_id)
            if finished:
                self._open.pop(req.request_id, None)
        if state is None:
            return
        try:
            with state.lock:
                state.closed = finished
                self._respond(state, req, new, finished)
        except Exception:  # a vanished client must not stop the scheduler thread
            logger.exception("sending a response for request %r failed", state.triton_id)

    def _respond(self, state: _Open, req, new: list[int], finished: bool) -> None:
        seq = req.seq
        if new:
            state.last_token_ns = time.time_ns()
            state.first_token_ns = state.first_token_ns or state.last_token_ns
        # the sink's final flag ends the whole Triton request: a row of a batch sends it only as the last to finish
        final = finished and (state.rows is None or state.rows.finish())
        try:
            if finished and seq.finish_reason == "cancelled":
                if not self.decoupled:  # exactly one response per request
                    state.sink.send(None, "the request was cancelled before it finished.", final=True,
                                    code="CANCELLED")
                elif final:
                    state.sink.send(None, None, final=True)  # flags only: the ensemble ends the stream cleanly
            elif state.streaming:
                if new or finished:
                    state.sink.send(response_tensors(new, state.sent, seq, state, req), None, final=final)
            elif finished:
                state.sink.send(response_tensors(list(seq.output), [], seq, state, req), None, final=final)
        finally:  # counted whether or not the send went through (one to a client that cancelled or went away
            # can fail; `_on_tokens` logs it): a failed send left the request's tokens and outcome uncounted
            if self.metrics:
                self.metrics.step(len(new), generation_step=bool(state.sent))  # the first tokens: the prompt step
                if finished:
                    self.metrics.finished("cancelled" if seq.finish_reason in ("cancelled", "stopped")
                                          else "completed")
                    self.metrics.request_tokens(len(state.request.spec.prompt), len(state.sent) + len(new))
            state.sent += new

    # ---- monitor thread -------------------------------------------------------------------------------------
    def _monitor_loop(self) -> None:
        last_metrics = 0.0
        while not self._closing.wait(CANCEL_POLL_S):
            with self._lock:
                open_items = list(self._open.items())
            for key, state in open_items:
                with state.lock:
                    if state.closed:
                        continue
                    try:
                        cancelled = state.sink.is_cancelled()
                    except Exception:  # the sender is gone with its client
                        cancelled = True
                if cancelled:
                    self.scheduler.cancel(key)
            now = time.monotonic()
            if self.metrics and now - last_metrics >= METRICS_PERIOD_S:
                try:
                    self.metrics.update_scheduler(self.scheduler.metrics())
                except Exception:  # metrics must never stop cancellation polling
                    logger.exception("updating the Prometheus metrics failed")
                last_metrics = now

    # ---- shutdown -------------------------------------------------------------------------------------------
    def close(self, drain_timeout: float = 5.0) -> None:
        """End open requests (clients get a final response), stop the scheduler and the follower ranks."""
        from ..runtime.distributed import shutdown_dist
        from ..runtime.engine import thaw_heap

        self.scheduler.cancel_all()
        deadline = time.monotonic() + drain_timeout
        while time.monotonic() < deadline:
            m = self.scheduler.metrics()
            if not m.running and not m.waiting:
                break
            time.sleep(0.01)
        self._closing.set()
        self._monitor.join(timeout=1.0)
        self.scheduler.stop()  # also tells the follower ranks to exit
        if self.followers is not None:
            try:
                self.followers.wait(timeout=FOLLOWER_EXIT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                logger.warning("follower ranks did not exit; killing mpirun")
                self.followers.kill()
                self.followers.wait()
        shutdown_dist()
        thaw_heap()
        if self.metrics is not None:  # before the stub's own teardown, which would segfault on live families
            self.metrics.release()
            self.metrics = None
