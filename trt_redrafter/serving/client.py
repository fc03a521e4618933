"""A gRPC streaming client for the served ensemble (or the engine model directly).

Decoupled models answer only over the streaming API, so every request goes through `start_stream` even when
`stream=False` asks the server for a single response. `generate_one` sends one request on its own stream and
returns what arrived and when; threads calling it concurrently make concurrent requests (the `generate` command,
the serving tests and scripts/load_test.py all use it).
"""

from __future__ import annotations

import queue
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from . import ENGINE_MODEL, ENSEMBLE_MODEL

STATS = ("acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens")


@dataclass
class GenerationRequest:
    prompt: str = ""
    apply_chat_template: bool = False  # ensemble only: the prompt is one user message, templated by the server
    max_tokens: int = 64
    temperature: Optional[float] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    end_id: Optional[int] = None  # -1: do not stop at EOS
    stop_words: tuple[str, ...] = ()
    stream: bool = True
    prompt_ids: Optional[list[int]] = None  # engine model only: token ids instead of text
    decoding_mode: Optional[str] = None  # torch engine only: "redrafter" (default) | "ar"
    proposer: Optional[str] = None  # torch engine only: "redrafter" | "ngram" | "mixed" (default: the engine's)
    return_perf_metrics: bool = True  # TensorRT-LLM's C++ backend sends the acceptance statistics only when asked
    return_log_probs: bool = False  # output_log_probs and cum_log_probs in each response
    top_logprobs: int = 0  # torch engine model only: the N most likely tokens at each position (top_token_ids, ...)
    cache_salt: Optional[str] = None  # torch engine model only: share cached KV blocks only with this salt's requests
    guide_type: Optional[str] = None  # guided_decoding_guide_type (json, json_schema, regex, ...; torch engines)
    guide: Optional[str] = None  # and guided_decoding_guide (the schema, regex or grammar)


@dataclass
class Chunk:
    t: float  # seconds since the request was sent
    text: str
    output_ids: list[int]
    final: bool
    log_probs: list[float] = field(default_factory=list)  # output_log_probs: every output token's so far
    cum_log_prob: Optional[float] = None  # cum_log_probs: their sum


@dataclass
class GenerationOutcome:
    request_id: str
    chunks: list[Chunk] = field(default_factory=list)
    stats: dict = field(default_factory=dict)  # acceptance_rate, total_accepted_draft_tokens, total_draft_tokens
    error: Optional[str] = None
    final: bool = False  # a response flagged final arrived
    sent_at: float = 0.0  # time.perf_counter() when sent

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.chunks)

    @property
    def output_ids(self) -> list[int]:
        return [t for c in self.chunks for t in c.output_ids]

    @property
    def ttft_s(self) -> Optional[float]:
        """Time to the first response with tokens."""
        return next((c.t for c in self.chunks if c.output_ids), None)

    @property
    def e2e_s(self) -> Optional[float]:
        return self.chunks[-1].t if self.chunks else None

    @property
    def ms_per_token(self) -> Optional[float]:
        """(last token time - first token time) / (tokens - 1), measured here, as TPOT is."""
        n, first = len(self.output_ids), self.ttft_s
        last = next((c.t for c in reversed(self.chunks) if c.output_ids), None)
        if n < 2 or first is None or last is None:
            return None
        return (last - first) * 1e3 / (n - 1)

    def summary(self) -> dict:
        return {"request_id": self.request_id, "text": self.text, "output_ids": self.output_ids,
                "num_tokens": len(self.output_ids), "responses": len(self.chunks), "error": self.error,
                "ttft_ms": None if self.ttft_s is None else self.ttft_s * 1e3, "ms_per_token": self.ms_per_token,
                "e2e_ms": None if self.e2e_s is None else self.e2e_s * 1e3, **self.stats}


def _tensor(name: str, arr: np.ndarray):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    t = grpcclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
    t.set_data_from_numpy(arr)
    return t


def build_inputs(req: GenerationRequest, model: str = ENSEMBLE_MODEL, stop: bool = False) -> list:
    """TensorRT-LLM tensor names, batch dimension 1: the ensemble's, or the engine model's for token ids."""
    engine = model == ENGINE_MODEL
    names = ({"max_tokens": "request_output_len", "top_k": "runtime_top_k", "top_p": "runtime_top_p",
              "stream": "streaming"} if engine else {})
    n = lambda k: names.get(k, k)  # noqa: E731
    if engine:
        ids = np.asarray([req.prompt_ids or [0]], dtype=np.int32)
        inputs = [_tensor("input_ids", ids), _tensor("input_lengths", np.array([[ids.shape[1]]], np.int32))]
    else:
        inputs = [_tensor("text_input", np.array([[req.prompt.encode()]], dtype=object))]
    inputs.append(_tensor(n("max_tokens"), np.array([[req.max_tokens]], np.int32)))
    inputs.append(_tensor(n("stream"), np.array([[req.stream]], bool)))
    inputs.append(_tensor("return_perf_metrics", np.array([[req.return_perf_metrics]], bool)))
    if req.return_log_probs:
        inputs.append(_tensor("return_log_probs", np.array([[True]], bool)))
    if req.top_logprobs:
        if not engine:
            raise ValueError("top_logprobs is an input of the torch engine model only; send prompt_ids to it")
        inputs.append(_tensor("top_logprobs", np.array([[req.top_logprobs]], np.int32)))
    for key, value, dtype in (("temperature", req.temperature, np.float32), ("top_k", req.top_k, np.int32),
                              ("top_p", req.top_p, np.float32), ("seed", req.seed, np.uint64),
                              ("end_id", req.end_id, np.int32)):
        if value is not None:
            inputs.append(_tensor(n(key), np.array([[value]], dtype)))
    for key, value in (("decoding_mode", req.decoding_mode), ("proposer", req.proposer),
                       ("cache_salt", req.cache_salt if engine else None),
                       ("guided_decoding_guide_type", req.guide_type), ("guided_decoding_guide", req.guide)):
        if value is not None:
            inputs.append(_tensor(key, np.array([[value.encode()]], dtype=object)))
    if req.stop_words and not engine:
        inputs.append(_tensor("stop_words", np.array([[w.encode() for w in req.stop_words]], dtype=object)))
    if req.apply_chat_template and not engine:  # sent only when asked: stock TensorRT-LLM ensembles lack the input
        inputs.append(_tensor("apply_chat_template", np.array([[True]], bool)))
    if stop:
        inputs.append(_tensor("stop", np.array([[True]], bool)))
    return inputs


def _parse(result, t: float) -> Chunk:
    resp = result.get_response()
    final = resp.parameters["triton_final_response"].bool_param if "triton_final_response" in resp.parameters else False
    text_out = result.as_numpy("text_output")
    text = "" if text_out is None else b"".join(text_out.reshape(-1)).decode(errors="replace")
    ids = result.as_numpy("output_ids")
    lps, cum = result.as_numpy("output_log_probs"), result.as_numpy("cum_log_probs")
    return Chunk(t, text, [] if ids is None else ids.reshape(-1).tolist(), final,
                 [] if lps is None else lps.reshape(-1).tolist(), None if cum is None else float(cum.reshape(-1)[0]))


def generate_one(url: str, req: GenerationRequest, model: str = ENSEMBLE_MODEL, request_id: Optional[str] = None,
                 on_chunk: Optional[Callable[[Chunk], None]] = None, timeout: float = 300.0,
                 cancel_after: Optional[int] = None) -> GenerationOutcome:
    """Send one request on its own gRPC stream and collect its responses until the final one.

    `cancel_after=k` cancels the request (stop_stream(cancel_requests=True)) once k responses have arrived.
    """
    import tritonclient.grpc as grpcclient

    rid = request_id or uuid.uuid4().hex[:12]
    out = GenerationOutcome(rid)
    q: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    try:
        client.start_stream(callback=lambda result, error: q.put((time.perf_counter(), result, error)))
        out.sent_at = time.perf_counter()
        client.async_stream_infer(model, build_inputs(req, model), request_id=rid, enable_empty_final_response=True)
        deadline = out.sent_at + timeout
        while not out.final:
            try:
                t, result, error = q.get(timeout=max(deadline - time.perf_counter(), 0.0))
            except queue.Empty:
                out.error = f"no final response within {timeout:.0f} s"
                break
            if error is not None:
                out.error = str(error)
                break
            chunk = _parse(result, t - out.sent_at)
            out.final = chunk.final
            for name in STATS:
                x = result.as_numpy(name)
                if x is not None:
                    out.stats[name] = x.reshape(-1)[0].item()
            if chunk.output_ids or chunk.text or not chunk.final:
                out.chunks.append(chunk)
                if on_chunk is not None:
                    on_chunk(chunk)
            if cancel_after is not None and len(out.chunks) >= cancel_after and not out.final:
                client.stop_stream(cancel_requests=True)
                out.error = "cancelled"
                break
        client.stop_stream()
    finally:
        client.close()
    return out


def send_stop(url: str, request_id: str, model: str = ENSEMBLE_MODEL, timeout: float = 30.0) -> None:
    """TensorRT-LLM's early stop: a `stop=true` request with the id of the request to end."""
    import tritonclient.grpc as grpcclient

    q: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    try:
        client.start_stream(callback=lambda result, error: q.put(error))
        client.async_stream_infer(model, build_inputs(GenerationRequest(prompt="stop", max_tokens=1,
                                                                        prompt_ids=[0]), model, stop=True),
                                  request_id=request_id, enable_empty_final_response=True)
        error = q.get(timeout=timeout)
        if error is not None:
            raise RuntimeError(f"stop request for {request_id!r} failed: {error}")
        client.stop_stream()
    finally:
        client.close()
