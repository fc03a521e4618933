"""The OpenAI-compatible HTTP API (FastAPI): /v1/models, /v1/completions, /v1/chat/completions, /health.

A request is checked (protocol.py), tokenized here with the repository's tokenizer (chat: the model's own chat
template, trt_redrafter/chat.py), checked against the engine's limits, and streamed from the engine model
(engine_client.py); generation.py turns the engine's tokens into text. Streaming answers are server-sent events
ending with `data: [DONE]`; the first engine response is awaited before the HTTP status is sent, so a Triton that
cannot be reached or an engine that refuses the request still gets its status code (503 / 400), not an error event.
A client that goes away cancels its Triton request: while streaming, Starlette cancels the response's generator;
before that (non-streaming, or waiting for the first token) the disconnect is polled.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import asynccontextmanager
from typing import AsyncIterator, Awaitable, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ...chat import chat_ids
from ...errors import UserError
from ...log import get_logger
from ..client import GenerationRequest
from ..text import TextCodec
from . import protocol as P
from .engine_client import ServedModel, TritonEngine
from .generation import Generation, Step

logger = get_logger(__name__)

DISCONNECT_POLL_S = 0.1  # how often a client waiting for a non-streamed answer is checked for having gone


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


def create_app(model: ServedModel, grpc_url: str, codec: Optional[TextCodec] = None) -> FastAPI:
    codec = codec or TextCodec(model.tokenizer_dir)

    @asynccontextmanager
    async def lifespan(app):
        app.state.engine = TritonEngine(grpc_url, coded=model.backend == "torch")
        try:
            yield
        finally:
            await app.state.engine.close()

    app = FastAPI(title="trt-redrafter OpenAI-compatible API", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)

    def error_response(e: P.APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(P.APIError)
    async def _api_error(request, e: P.APIError):
        return error_response(e)

    @app.exception_handler(HTTPException)
    async def _http_error(request, e: HTTPException):  # unknown routes, wrong methods: in OpenAI's shape too
        message = (f"unknown request URL: {request.method} {request.url.path}" if e.status_code == 404
                   else f"{request.method} {request.url.path}: {e.detail}")
        return error_response(P.APIError(e.status_code, message, code="not_found" if e.status_code == 404 else None))

    @app.exception_handler(Exception)
    async def _internal(request, e: Exception):
        logger.exception("%s %s failed", request.method, request.url.path)
        return error_response(P.APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))

    # ---- routes ----------------------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if await app.state.engine.ready():
            return {"status": "ok"}
        return error_response(P.APIError(503, f"the engine model is not ready on Triton at {grpc_url}.",
                                          type="server_error", code="engine_not_ready"))

    def model_card() -> dict:
        return {"id": model.name, "object": "model", "created": model.created, "owned_by": "trt-redrafter"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def one_model(name: str):
        check_model(name)
        return model_card()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    # ---- generation ------------------------------------------------------------------------------------------
    def check_model(name: str) -> None:
        if name != model.name:
            raise P.APIError(404, f"the model '{name}' does not exist; this server serves '{model.name}'.",
                             param="model", code="model_not_found")

    def prompt_ids(req: P.SamplingRequest) -> list[int]:
        if req.messages is not None:
            try:
                return chat_ids(codec.tok, req.messages)
            except UserError as e:  # the model's template refused these messages (roles out of order, ...)
                raise P.bad_value("messages", str(e)) from e
        return list(req.prompt) if isinstance(req.prompt, list) else codec.encode(req.prompt)

    def max_tokens(req: P.SamplingRequest, n_prompt: int) -> int:
        what = "messages" if req.messages is not None else "prompt"
        left = model.max_seq_len - n_prompt
        if n_prompt > model.max_input_len or left < 1:
            raise P.APIError(400, f"the prompt has {n_prompt} tokens but the engine takes at most "
                                  f"{min(model.max_input_len, model.max_seq_len - 1)}; shorten the {what}.",
                             param=what, code="context_length_exceeded")
        if req.max_tokens is None:
            return left
        if req.max_tokens > left:
            raise P.APIError(400, f"max_tokens={req.max_tokens} with a {n_prompt}-token prompt exceeds the engine's "
                                  f"context of {model.max_seq_len} tokens; ask for at most {left}.",
                             param="max_tokens", code="context_length_exceeded")
        return req.max_tokens

    async def generate(request: Request, chat: bool):
        body = P.parse_json_body(await request.body())
        req = P.parse_chat(body) if chat else P.parse_completion(body)
        check_model(req.model)
        if req.decoding_mode is not None and model.backend != "torch":
            raise P.unsupported("decoding_mode", "TensorRT-LLM's engine fixes its decoding mode when it is built.")
        if req.cache_salt is not None and model.backend != "torch":
            raise P.unsupported("cache_salt", "TensorRT-LLM's Triton backend takes no cache salt.")
        if req.guide_type is not None and model.backend != "torch":
            raise P.unsupported("response_format", "TensorRT-LLM's C++ runtime does not apply a grammar to ReDrafter's "
                                                   "draft tokens (its guided decoder masks one logits row per step; "
                                                   "docs/tensorrt-llm.md); serve a torch engine for structured output.")
        if req.logprobs and model.backend != "torch":
            raise P.unsupported("logprobs", "TensorRT-LLM's ReDrafter decoding computes no log-probabilities (its "
                                            "explicit-draft-tokens decoder layer writes none; docs/tensorrt-llm.md).")
        ids = prompt_ids(req)
        engine_req = GenerationRequest(
            prompt_ids=ids, max_tokens=max_tokens(req, len(ids)), temperature=req.temperature, top_p=req.top_p,
            top_k=req.top_k, seed=req.seed, end_id=-1 if req.ignore_eos else codec.end_id,
            # a non-decoupled engine model (make-repo --decoupled false) answers once: a stream is then one chunk
            stream=model.decoupled,
            decoding_mode=req.decoding_mode, return_log_probs=req.logprobs, top_logprobs=req.top_logprobs,
            cache_salt=req.cache_salt, guide_type=req.guide_type, guide=req.guide)
        if req.temperature == 0 and model.backend == "tensorrtllm":  # TensorRT-LLM decodes greedily with top_k 1
            engine_req.temperature, engine_req.top_k, engine_req.top_p = None, 1, None
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        steps = app.state.engine.stream(engine_req, rid)
        gen = Generation(codec, req.stop, engine_req.end_id)
        out = _Answer(rid, int(time.time()), model.name, chat, len(ids), gen, model.kv_block_size, req.logprobs)
        try:
            if not req.stream:
                await until_disconnected(request, collect(steps, gen))
                return out.body()
            first = await until_disconnected(request, anext(steps, None))
        except ClientGone:
            logger.info("client of %s went away; its Triton request is cancelled", rid)
            return Response(status_code=499)
        finally:
            if not req.stream:
                await steps.aclose()
        return StreamingResponse(out.events(steps, first, req.include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return app


async def collect(steps: AsyncIterator[Step], gen: Generation) -> None:
    async for step in steps:
        gen.on_step(step)
        if gen.done:
            return  # a stop string: the caller closes `steps`, which cancels the rest
    if not gen.done:
        gen.finish()


async def until_disconnected(request, awaitable: Awaitable):
    """Await `awaitable`, cancelling it (and so its Triton request) if the HTTP client disconnects meanwhile."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


class _Answer:
    """The response of one request, whole or as server-sent events."""

    def __init__(self, rid: str, created: int, model: str, chat: bool, prompt_tokens: int, gen: Generation,
                 block_size: int = 0, logprobs: bool = False):
        self.rid, self.created, self.model, self.chat = rid, created, model, chat
        self.prompt_tokens, self.gen, self.block_size, self.logprobs = prompt_tokens, gen, block_size, logprobs

    def usage(self) -> dict:
        reused = self.gen.stats.reused_blocks
        cached = None if reused is None else min(reused * self.block_size, self.prompt_tokens)
        return P.usage(self.prompt_tokens, self.gen.completion_tokens, cached)

    def body(self) -> dict:
        make = P.chat_body if self.chat else P.completion_body
        return make(self.rid, self.created, self.model, self.gen.text, self.gen.finish_reason, self.usage(),
                    self.gen.stats.as_dict(), self._logprobs())

    def _logprobs(self) -> Optional[dict]:
        """The logprobs field for the tokens logged since the last chunk (all of them, for a whole answer)."""
        if not self.logprobs:
            return None
        tokens, offset = self.gen.take_logged()
        return P.chat_logprobs(tokens) if self.chat else P.completion_logprobs(tokens, offset)

    def chunk(self, text: Optional[str], finish_reason: Optional[str] = None, role: bool = False,
              logprobs: Optional[dict] = None) -> dict:
        if not self.chat:
            return P.completion_chunk(self.rid, self.created, self.model, text or "", finish_reason, logprobs)
        delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
        return P.chat_chunk(self.rid, self.created, self.model, delta, finish_reason, logprobs)

    async def events(self, steps: AsyncIterator[Step], first: Optional[Step], include_usage: bool):
        gen = self.gen
        try:
            if self.chat:
                yield P.sse(self.chunk(None, role=True))
            step = first
            while step is not None and not gen.done:
                text = gen.on_step(step)
                logprobs = self._logprobs()
                if text or (logprobs and (logprobs.get("content") or logprobs.get("tokens"))):
                    yield P.sse(self.chunk(text, logprobs=logprobs))
                if not gen.done:
                    step = await anext(steps, None)
            if not gen.done:
                text = gen.finish()
                if text:
                    yield P.sse(self.chunk(text))
            yield P.sse(self.chunk(None, gen.finish_reason))
            if include_usage:
                yield P.sse(P.usage_chunk(self.chunk(None), self.usage(), gen.stats.as_dict()))
            yield P.SSE_DONE
        except P.APIError as e:  # after the status line: the error goes out as an event, as OpenAI's do
            yield P.sse(e.body())
        finally:
            await steps.aclose()  # ends (cancels) the Triton request if it is still running
