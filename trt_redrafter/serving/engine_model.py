"""The torch engine behind Triton's `tensorrt_llm` model: Triton requests in, streamed responses out.

`trt_redrafter/triton_repo/tensorrt_llm/1/model.py` is a thin adapter: it turns each Triton request into a dict of
numpy inputs plus a `ResponseSink` and calls `EngineModel.submit`; everything else happens here, testable without
Triton. Flow:

    execute() -> submit()   parse the inputs, queue the request on the in-flight Scheduler, return at once
    scheduler thread        after every step, `_on_tokens` sends the request's new tokens (streaming) or,
                            once finished, all of them, the last response flagged final
    monitor thread          polls client cancellation (frees the request's KV blocks before the next step)
                            and refreshes the Prometheus gauges

Tensor names and semantics are TensorRT-LLM's `tensorrt_llm` model's (docs/serving.md): `output_ids` holds the
new tokens of a streaming response or the whole output otherwise (never the prompt: exclude_input_in_output),
`stop=true` with a request's id ends it early, and the final response carries `acceptance_rate`,
`total_accepted_draft_tokens` and `total_draft_tokens`. With tp > 1 this process is rank 0 and launches the
other ranks (`follower.py`) with mpirun.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol

import numpy as np

from ..config import PROPOSERS, SamplingConfig
from ..errors import ServerBusy, UserError
from ..log import get_logger
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

    def send(self, outputs: Optional[dict[str, np.ndarray]], error: Optional[str], final: bool) -> None: ...

    def is_cancelled(self) -> bool: ...


@dataclass
class ParsedRequest:
    prompt: list[int]
    params: SamplingConfig
    streaming: bool
    stop_ids: tuple[int, ...]
    stop_sequences: tuple[tuple[int, ...], ...]
    mode: str = "redrafter"  # "redrafter" | "ar": the optional `decoding_mode` input (torch engine only)
    proposer: Optional[str] = None  # the optional `proposer` input: redrafter | ngram | mixed (None: the engine's)


@dataclass
class _Open:
    """A request in flight: where its responses go and what was sent already."""

    triton_id: str
    sink: ResponseSink
    streaming: bool
    sent: list[int] = field(default_factory=list)
    generation_steps: int = 0
    # Triton frees a response sender once its final response is sent, and `is_cancelled()` on it afterwards
    # crashes tritonserver (SIGSEGV in TRITONBACKEND_ResponseFactoryIsCancelled, seen under load): the final
    # send and the monitor's cancellation poll are serialized by this lock, and `closed` ends the polling.
    lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False


def _scalar(inputs: dict[str, np.ndarray], name: str, default=None):
    x = inputs.get(name)
    if x is None:
        return default
    if x.size != 1:
        raise UserError(f"input '{name}' must hold one value per request, got shape {list(x.shape)}.")
    return x.reshape(-1)[0].item()


def is_stop_request(inputs: dict[str, np.ndarray]) -> bool:
    return bool(_scalar(inputs, "stop", False))


def parse_inputs(inputs: dict[str, np.ndarray]) -> ParsedRequest:
    """TensorRT-LLM `tensorrt_llm` inputs (with Triton's batch dimension of 1) -> a request; UserError if bad.
    The engine's own limits (max_input_len, max_seq_len, vocabulary) are checked by `Scheduler.submit`."""
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
                                seed=int(_scalar(inputs, "seed", 0)))
        params.validate()
    except UserError as e:
        raise UserError(f"bad sampling parameters: {e}") from e
    end_id = _scalar(inputs, "end_id")
    stop_ids = () if end_id is None or end_id < 0 else (int(end_id),)
    stop_sequences = ()
    if inputs.get("stop_words_list") is not None:
        stop_sequences = list_to_words(inputs["stop_words_list"].reshape(2, -1))
    if inputs.get("bad_words_list") is not None and list_to_words(inputs["bad_words_list"].reshape(2, -1)):
        logger.info("bad_words are accepted but not applied by the torch engine; ignoring them")
    mode = _string(inputs, "decoding_mode") or "redrafter"
    if mode not in DECODING_MODES:
        raise UserError(f"decoding_mode must be one of {', '.join(DECODING_MODES)}, got {mode!r}.")
    proposer = _string(inputs, "proposer")
    if proposer and proposer not in PROPOSERS:
        raise UserError(f"proposer must be one of {', '.join(PROPOSERS)}, got {proposer!r}.")
    return ParsedRequest(prompt, params, bool(_scalar(inputs, "streaming", False)), stop_ids, stop_sequences,
                         DECODING_MODES[mode], proposer or None)


def _string(inputs: dict[str, np.ndarray], name: str) -> str:
    """An optional one-value BYTES input, decoded, stripped and lower-cased ('' when absent)."""
    x = inputs.get(name)
    if x is None:
        return ""
    if x.size != 1:
        raise UserError(f"input '{name}' must hold one value per request, got shape {list(x.shape)}.")
    v = x.reshape(-1)[0]  # BYTES arrive as an object array of bytes
    return (v.decode(errors="replace") if isinstance(v, bytes) else str(v)).strip().lower()


def response_tensors(new: list[int], preceding: list[int], seq) -> dict[str, np.ndarray]:
    """One response's tensors, with Triton's batch dimension: output_ids [1, beam=1, n]."""
    st = seq.stats
    return {
        "output_ids": np.asarray(new, dtype=np.int32).reshape(1, 1, -1),
        "sequence_length": np.array([[len(new)]], dtype=np.int32),
        "acceptance_rate": np.array([[st.acceptance_rate]], dtype=np.float32),
        "total_accepted_draft_tokens": np.array([[st.accepted_draft_tokens]], dtype=np.int32),
        "total_draft_tokens": np.array([[st.draft_tokens]], dtype=np.int32),
        "preceding_output_ids": np.asarray(preceding, dtype=np.int32).reshape(1, -1),
    }


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
                 max_queue_size: int = 0):
        """decoupled: the model's transaction policy. Decoupled, a request may stream (many responses, the last
        flagged final); otherwise every request gets exactly one response (streaming is refused at once), which is
        what unary gRPC ModelInfer and HTTP infer need. max_queue_size: requests waiting beyond the running batch
        before new ones are refused as busy (0: no limit)."""
        from ..config import RuntimeConfig
        from ..runtime.distributed import free_port, init_dist_tcp
        from ..runtime.engine import Engine
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
        self.engine = Engine(engine_dir, self.dist, runtime)
        self.decoupled = decoupled
        self.scheduler = Scheduler(self.engine, max_queue_size=max_queue_size).start()
        self.metrics = None
        if metrics_family is not None:
            from .metrics import ServingMetrics

            self.metrics = ServingMetrics(metrics_family, {"model": model_name},
                                          self.engine.redrafter.draft_len_per_beam + 1)
        self._lock = threading.Lock()
        self._open: dict[str, _Open] = {}  # internal request id -> state
        self._ids = itertools.count()
        self._closing = threading.Event()
        self._monitor = threading.Thread(target=self._monitor_loop, name="trt-redrafter-monitor", daemon=True)
        self._monitor.start()
        logger.info("serving %s (tp=%d, max_batch_size=%d, KV blocks=%d)", engine_dir, tp_size,
                    self.engine.build.max_batch_size, self.engine.cache.num_blocks)

    # ---- requests (Triton's execute thread) -----------------------------------------------------------------
    def submit(self, triton_id: str, inputs: dict[str, np.ndarray], sink: ResponseSink) -> None:
        from ..runtime.scheduler import Request

        if is_stop_request(inputs):
            self.stop_request(triton_id)
            sink.send(None if self.decoupled else {}, None, final=True)
            return
        try:
            p = parse_inputs(inputs)
            if p.streaming and not self.decoupled:
                raise UserError("streaming needs a decoupled model, and this repository's tensorrt_llm model is not "
                                "decoupled; send streaming=false, or make the repository with `make-repo "
                                "--decoupled true`.")
            rid = f"{triton_id}#{next(self._ids)}"
            state = _Open(triton_id, sink, p.streaming)
            with self._lock:
                self._open[rid] = state
            try:
                self.scheduler.submit(Request(rid, p.prompt, p.params, p.mode, p.stop_ids, p.stop_sequences,
                                              on_tokens=self._on_tokens, proposer=p.proposer))
            except BaseException:
                with self._lock:
                    self._open.pop(rid, None)
                raise
        except UserError as e:
            if self.metrics:
                self.metrics.finished("busy" if isinstance(e, ServerBusy) else "rejected")
            sink.send(None, str(e), final=True)

    def stop_request(self, triton_id: str) -> int:
        """TensorRT-LLM's early stop: end every open request with this id (all of them for DRAIN_REQUEST_ID)."""
        with self._lock:
            ids = [rid for rid, s in self._open.items() if triton_id in (s.triton_id, DRAIN_REQUEST_ID)]
        for rid in ids:
            self.scheduler.cancel(rid)
        if ids:
            logger.info("stop request %r ends %d request(s)", triton_id, len(ids))
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
        if finished and seq.finish_reason == "cancelled":
            if self.decoupled:
                state.sink.send(None, None, final=True)  # flags only: the ensemble ends the stream cleanly
            else:  # exactly one response per request
                state.sink.send(None, "the request was cancelled before it finished.", final=True)
        elif state.streaming:
            if new or finished:
                state.sink.send(response_tensors(new, state.sent, seq), None, final=finished)
        elif finished:
            state.sink.send(response_tensors(list(seq.output), [], seq), None, final=True)
        if self.metrics:
            self.metrics.step(len(new), generation_step=bool(state.sent))  # the first tokens come from the prompt step
            if finished:
                self.metrics.finished("cancelled" if seq.finish_reason == "cancelled" else "completed")
        state.sent += new

    # ---- monitor thread -------------------------------------------------------------------------------------
    def _monitor_loop(self) -> None:
        last_metrics = 0.0
        while not self._closing.wait(CANCEL_POLL_S):
            with self._lock:
                open_items = list(self._open.items())
            for rid, state in open_items:
                with state.lock:
                    if state.closed:
                        continue
                    try:
                        cancelled = state.sink.is_cancelled()
                    except Exception:  # the sender is gone with its client
                        cancelled = True
                if cancelled:
                    self.scheduler.cancel(rid)
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
