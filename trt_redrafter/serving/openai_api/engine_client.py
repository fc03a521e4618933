"""The frontend's side of Triton: what the repository serves (`ServedModel`) and one streaming gRPC call per request
to the decoupled `tensorrt_llm` model (`TritonEngine`, tritonclient's asyncio client).

The frontend tokenizes itself and sends token ids to the engine model, not text to the ensemble: it then knows
every token (usage counts, stop strings checked token by token, its own incremental detokenization), and a client
cancellation reaches the engine (Triton 2.51 does not forward one through an ensemble, docs/serving.md). Every
request asks Triton for streaming, so each response is one decode step's tokens; a request the frontend stops
early (stop string, client gone) is cancelled by cancelling its gRPC call, which frees its KV blocks.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Optional

from ...decoding.logprobs import TokenLogprob
from ...errors import UserError
from .. import ENGINE_MODEL
from ..client import GenerationRequest, build_inputs
from ..repo import repo_parameter
from .generation import Step
from .protocol import APIError


@dataclass
class ServedModel:
    """What /v1/models lists and what requests are checked against, read from the repository make-repo wrote."""

    name: str
    repo: Path
    engine_dir: Path
    tokenizer_dir: Path
    max_input_len: int
    max_seq_len: int
    created: int  # the engine's config.json mtime (OpenAI's `created`)
    backend: str  # torch | tensorrtllm (decoding_mode is the torch engine's input only)
    decoupled: bool = True  # the engine model streams (make-repo --decoupled); else each request is one response
    kv_block_size: int = 64  # tokens per KV block: a reused block is this many cached prompt tokens


def served_model(repo: str | Path, name: Optional[str] = None) -> ServedModel:
    from ...checkpoint.engine_config import load_engine_config

    repo = Path(repo).absolute()
    engine = repo_parameter(repo, ENGINE_MODEL, "engine_dir")
    backend = "torch"
    if engine is None:
        engine, backend = repo_parameter(repo, ENGINE_MODEL, "gpt_model_path"), "tensorrtllm"
    tokenizer = repo_parameter(repo, "preprocessing", "tokenizer_dir")
    if engine is None or tokenizer is None:
        raise UserError(f"{repo} is not a model repository made by `trt-redrafter make-repo` (its tensorrt_llm model "
                        f"names no engine or its preprocessing model no tokenizer_dir); make one with make-repo.")
    cfg = load_engine_config(engine)
    policy = re.search(r"model_transaction_policy\s*\{\s*decoupled:\s*(\w+)",
                       (repo / ENGINE_MODEL / "config.pbtxt").read_text())
    decoupled = policy is None or policy.group(1).lower() == "true"
    return ServedModel(name or Path(engine).name, repo, Path(engine), Path(tokenizer), cfg.build.max_input_len,
                       cfg.build.max_seq_len, int(os.path.getmtime(Path(engine) / "config.json")), backend, decoupled,
                       cfg.build.kv_block_size)


def _value(result, name: str):
    x = result.as_numpy(name)
    return None if x is None else x.reshape(-1)[0].item()


def _logprobs(result, n: int) -> Optional[list[TokenLogprob]]:
    """The log-probabilities of a response's n new tokens: the last n of its output_log_probs [beam=1, all so far],
    with its top_token_ids / top_log_probs [n, k] (where sent)."""
    lps = result.as_numpy("output_log_probs")
    if lps is None:
        return None
    ids, tops = result.as_numpy("top_token_ids"), result.as_numpy("top_log_probs")
    lps = lps.reshape(-1).tolist()[-n:] if n else []
    if ids is None or tops is None:
        return [TokenLogprob(x) for x in lps]
    ids, tops = ids.reshape(len(lps), -1).tolist(), tops.reshape(len(lps), -1).tolist()
    return [TokenLogprob(x, tuple(zip(i, t))) for x, i, t in zip(lps, ids, tops)]


class TritonEngine:
    """Streams requests to the engine model over one gRPC channel (create it inside the running event loop)."""

    def __init__(self, url: str, model: str = ENGINE_MODEL, coded: bool = True):
        """`coded`: the engine model gives a client's mistakes the status INVALID_ARGUMENT (the torch engine's
        model does; TensorRT-LLM's backend's errors are all taken for the client's, as before)."""
        import tritonclient.grpc.aio as grpcclient

        self.url, self.model, self.coded = url, model, coded
        self.client = grpcclient.InferenceServerClient(url)

    async def ready(self) -> bool:
        try:
            return bool(await self.client.is_model_ready(self.model))
        except Exception:  # unreachable, or not serving yet: not ready either way
            return False

    async def stream(self, req: GenerationRequest, request_id: str) -> AsyncIterator[Step]:
        """The request's responses as Steps. APIError 503 when Triton cannot be reached, 400 when the engine
        refuses the request. Closing the generator early cancels the request."""
        import grpc
        from tritonclient.utils import InferenceServerException

        assert req.prompt_ids, "requests go to the engine model as token ids"

        async def one_request():
            yield {"model_name": self.model, "inputs": build_inputs(req, self.model), "request_id": request_id}

        call, last, ended = None, None, False
        try:
            call = self.client.stream_infer(one_request())
            async for result, error in call:
                if error is not None:
                    raise await self._refused(error)
                ids = result.as_numpy("output_ids")
                params = result.get_response().parameters
                final = params["triton_final_response"].bool_param if "triton_final_response" in params else False
                ids = [] if ids is None else ids.reshape(-1).tolist()
                step = Step(ids, final,
                            _value(result, "total_accepted_draft_tokens"), _value(result, "total_draft_tokens"),
                            _value(result, "acceptance_rate"), _value(result, "kv_cache_reused_blocks"),
                            _logprobs(result, len(ids)) if req.return_log_probs else None)
                if final:
                    # Triton ends the call right after the final response (the request side is closed): let it end
                    # before the consumer, which stops here, closes this generator. Cancelling a call whose request
                    # has completed kept the engine model from unloading at shutdown (Triton 2.51).
                    last = step
                    continue
                yield step
            ended = True
        except (grpc.RpcError, InferenceServerException) as e:
            detail = e.details() if isinstance(e, grpc.RpcError) else str(e)
            raise APIError(503, f"Triton at {self.url} cannot be reached ({detail}); is `trt-redrafter serve` "
                                f"running?", type="server_error", code="triton_unavailable") from e
        finally:
            if call is not None and not ended:
                call.cancel()  # the consumer stopped early (stop string, client gone): Triton cancels the request
        if last is not None:
            yield last

    async def _refused(self, error) -> APIError:
        """An engine error as the API's: 400 for a request the client can fix (the torch engine model marks those
        INVALID_ARGUMENT), 503 when the engine model is not ready, busy, or failed otherwise (a dead model process:
        Triton's `Stub process ... is not healthy.`)."""
        if not await self.ready():
            return APIError(503, f"the engine model '{self.model}' is not ready on Triton at {self.url}: "
                                 f"{error.message()}", type="server_error", code="engine_not_ready")
        status = str(error.status() or "")  # empty where the stream's error carries none: taken for the client's
        if self.coded and status and "INVALID_ARGUMENT" not in status:
            return APIError(503, f"the engine model '{self.model}' cannot serve the request now ({status}: "
                                 f"{error.message()})", type="server_error", code="engine_unavailable")
        return APIError(400, f"the engine refused the request: {error.message()}", code="engine_refused")

    async def close(self) -> None:
        await self.client.close()
