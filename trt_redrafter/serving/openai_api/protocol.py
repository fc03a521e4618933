"""OpenAI's request and response shapes: request bodies checked field by field into `SamplingRequest`, errors in
OpenAI's JSON shape, and the response / server-sent-event bodies. No web framework here (unit-tested alone).

What is accepted (a field not listed is ignored, as OpenAI ignores `user`):
    model              required; the one served name (/v1/models), else 404 model_not_found
    prompt             /v1/completions: a string, or token ids, or a list holding one of those
    messages           /v1/chat/completions: system / developer / user / assistant turns, content a string or a
                       list of text parts
    max_tokens         completions: default 16 (OpenAI's); chat (also `max_completion_tokens`): default what is left of
                       the engine's max_seq_len after the prompt
    temperature        [0, 2], default 1 (OpenAI's; 0 is greedy)
    top_p              (0, 1], default 1
    seed               an integer (taken modulo 2**63); without one each request draws its own (the engine's
                       default seed is 0, which would give every request the same samples)
    stop               a string or a list of strings; the text ends before the first one found
    stream, stream_options.include_usage
    n, best_of         1 only
    logprobs           chat: true/false, with `top_logprobs` 0..20 (true needed); completions: 0..20 top tokens. The
                       model's log-probabilities (docs/serving.md): chat's `logprobs.content`, completions' `tokens`,
                       `token_logprobs`, `top_logprobs`, `text_offset`; streamed with each chunk's tokens
    extensions         top_k (>= 0, 0 = off), ignore_eos (bool), decoding_mode ("redrafter" | "ar": the torch
                       engine decodes the request auto-regressively), cache_salt (a non-empty string: the request
                       shares cached KV blocks only with requests of the same salt, as vLLM's)
    structured output  response_format {"type": "json_object"} | {"type": "json_schema", "json_schema": {"schema"}}
                       | {"type": "structural_tag", "structures", "triggers"}; vLLM's extensions guided_json,
                       guided_regex, guided_grammar, guided_choice and structured_outputs {json | regex | grammar |
                       choice}: one of them per request (runtime/grammar.py)
Refused with a 400 naming the field: echo, suffix, logit_bias, non-zero presence/frequency penalties, tools: the
engine has none of them.
"""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from ...config import MAX_SEED

MAX_TEMPERATURE = 2.0  # OpenAI's range
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DECODING_MODES = ("redrafter", "ar")
CHAT_ROLES = ("system", "developer", "user", "assistant")
MAX_TOP_LOGPROBS = 20  # OpenAI's limit of top_logprobs (the engine may allow fewer: its max_logprobs)


class APIError(Exception):
    """An error answered in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: Optional[str] = None,
                 code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_value(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def unsupported(param: str, why: str) -> APIError:
    return APIError(400, f"'{param}' is not supported by this server: {why}", param=param, code="unsupported_parameter")


@dataclass
class SamplingRequest:
    """One generation request, checked; the prompt is tokenized by the app."""

    model: str
    prompt: Union[str, list[int], None] = None  # completions: text or token ids
    messages: Optional[list[dict]] = None  # chat: [{"role", "content": str}]
    max_tokens: Optional[int] = None  # None: chat's default, what is left of the context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False
    decoding_mode: Optional[str] = None
    cache_salt: Optional[str] = None  # prefix reuse only among requests with this salt
    logprobs: bool = False  # return the output tokens' log-probabilities
    top_logprobs: int = 0  # and the N most likely tokens at each position
    guide_type: Optional[str] = None  # the output constraint, as guided_decoding_guide_type (json, json_schema, ...)
    guide: Optional[str] = None  # and its source
    extra: dict = field(default_factory=dict)


# ---- field checks ------------------------------------------------------------------------------------------------
def parse_json_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e}); send a JSON object.", code="invalid_json")
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got a JSON {type(body).__name__}.",
                       code="invalid_json")
    return body


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad_value(name, f"'{name}' must be a number, got {json.dumps(v)}.")
    if v < lo or (lo_open and v == lo) or v > hi:
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise bad_value(name, f"'{name}' must be in {interval}, got {v}.")
    return float(v)


def _integer(body: dict, name: str, default: Optional[int], lo: Optional[int] = None) -> Optional[int]:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_value(name, f"'{name}' must be an integer, got {json.dumps(v)}.")
    if lo is not None and v < lo:
        raise bad_value(name, f"'{name}' must be at least {lo}, got {v}.")
    return v


def _boolean(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_value(name, f"'{name}' must be true or false, got {json.dumps(v)}.")
    return v


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    words = [v] if isinstance(v, str) else v
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        raise bad_value("stop", f"'stop' must be a string or a list of strings, got {json.dumps(v)}.")
    return tuple(w for w in words if w)


def _refuse_unsupported(body: dict, chat: bool) -> None:
    """The OpenAI features the engine lacks: a clear 400 rather than an answer that silently ignores them."""
    if _integer(body, "n", 1, lo=1) != 1:
        raise unsupported("n", "the engine decodes one output per request; send n=1 and repeat the request.")
    if not chat and _integer(body, "best_of", 1, lo=1) != 1:
        raise unsupported("best_of", "the engine decodes one output per request; send best_of=1.")
    if not chat and body.get("echo") not in (None, False):
        raise unsupported("echo", "the prompt is not echoed; prepend it yourself.")
    if not chat and body.get("suffix") not in (None, ""):
        raise unsupported("suffix", "insertion is not supported.")
    if body.get("logit_bias"):
        raise unsupported("logit_bias", "the engine does not bias logits.")
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, 0.0, -2.0, 2.0) != 0.0:
            raise unsupported(name, "the engine applies no penalties; send 0.")
    if chat and (body.get("tools") or body.get("functions")):
        raise unsupported("tools", "tool calling is not supported.")


def _guide(body: dict) -> tuple[Optional[str], Optional[str]]:
    """The request's output constraint as the engine model's inputs (guided_decoding_guide_type, _guide), from
    OpenAI's response_format or vLLM's spellings; (None, None) for free text."""
    found = []
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema", "structural_tag"):
            raise bad_value("response_format", "'response_format' must be {\"type\": \"text\"}, "
                                               "{\"type\": \"json_object\"}, {\"type\": \"json_schema\", "
                                               "\"json_schema\": {\"name\": ..., \"schema\": {...}}} or a structural tag.")
        if fmt["type"] == "json_object":
            found.append(("response_format", "json", ""))
        elif fmt["type"] == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
                raise bad_value("response_format", "'response_format' of type json_schema needs "
                                                   "\"json_schema\": {\"name\": ..., \"schema\": {...}}.")
            found.append(("response_format", "json_schema", json.dumps(spec["schema"])))
        elif fmt["type"] == "structural_tag":
            found.append(("response_format", "structural_tag",
                          json.dumps({k: v for k, v in fmt.items() if k != "type"})))
    kinds = ("json", "regex", "grammar", "choice")  # vLLM's: guided_KIND, and structured_outputs {KIND: ...}
    vllm = [(f"guided_{k}", k, body.get(f"guided_{k}")) for k in kinds]
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise bad_value("structured_outputs", "'structured_outputs' must be an object such as {\"regex\": ...}.")
        vllm += [(f"structured_outputs.{k}", k, so.get(k)) for k in kinds]
    for name, kind, v in vllm:
        if v is None:
            continue
        if kind == "json":
            found.append((name, "json_schema", v if isinstance(v, str) else json.dumps(v)))
        elif kind == "choice":
            if not isinstance(v, list) or not v or not all(isinstance(c, str) for c in v):
                raise bad_value(name, f"'{name}' must be a non-empty list of strings.")
            found.append((name, "regex", "(" + "|".join(re.escape(c) for c in v) + ")"))
        else:
            if not isinstance(v, str) or not v:
                raise bad_value(name, f"'{name}' must be a non-empty string.")
            found.append((name, "regex" if kind == "regex" else "ebnf_grammar", v))
    if len(found) > 1:
        raise bad_value(found[1][0], f"ask for one output constraint per request; got {', '.join(f[0] for f in found)}.")
    return (found[0][1], found[0][2]) if found else (None, None)


def _logprobs(body: dict, chat: bool) -> tuple[bool, int]:
    """(logprobs, top_logprobs): chat's `logprobs` (bool) + `top_logprobs` (0..20, needs logprobs), or completions'
    `logprobs` (0..20 top tokens; null: none)."""
    if chat:
        on = _boolean(body, "logprobs")
        top = _integer(body, "top_logprobs", 0, lo=0)
        if top and not on:
            raise bad_value("top_logprobs", "'top_logprobs' needs 'logprobs': true.")
    else:
        n = _integer(body, "logprobs", None, lo=0)
        on, top = n is not None, n or 0
    if top > MAX_TOP_LOGPROBS:
        name = "top_logprobs" if chat else "logprobs"
        raise bad_value(name, f"'{name}' must be at most {MAX_TOP_LOGPROBS}, got {top}.")
    return on, top


def _common(body: dict, chat: bool) -> SamplingRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise APIError(400, "'model' is required: the name /v1/models lists.", param="model",
                       code="missing_required_parameter" if model is None else "invalid_value")
    _refuse_unsupported(body, chat)
    max_tokens = _integer(body, "max_tokens", None, lo=1)
    if chat and max_tokens is None:
        max_tokens = _integer(body, "max_completion_tokens", None, lo=1)
    elif not chat and max_tokens is None:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    stream = _boolean(body, "stream")
    opts = body.get("stream_options")
    if opts is not None:
        if not stream:
            raise bad_value("stream_options", "'stream_options' is only allowed when 'stream' is true.")
        if not isinstance(opts, dict):
            raise bad_value("stream_options", f"'stream_options' must be an object, got {json.dumps(opts)}.")
    seed = _integer(body, "seed", None)
    mode = body.get("decoding_mode")
    if mode is not None and mode not in DECODING_MODES:
        raise bad_value("decoding_mode", f"'decoding_mode' must be one of {', '.join(DECODING_MODES)}, got "
                                         f"{json.dumps(mode)}.")
    logprobs, top = _logprobs(body, chat)
    guide_type, guide = _guide(body)
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise bad_value("cache_salt", f"'cache_salt' must be a non-empty string, got {json.dumps(salt)}.")
    return SamplingRequest(
        model=model, max_tokens=max_tokens, logprobs=logprobs, top_logprobs=top, cache_salt=salt,
        guide_type=guide_type, guide=guide,
        temperature=_number(body, "temperature", 1.0, 0.0, MAX_TEMPERATURE),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=_integer(body, "top_k", 0, lo=0),
        # without a seed a request must not repeat the last one's samples; the engine takes seeds in [0, 2**63)
        seed=random.randrange(MAX_SEED) if seed is None else seed % MAX_SEED,
        stop=_stop(body), stream=stream,
        include_usage=_boolean(opts or {}, "include_usage"),
        ignore_eos=_boolean(body, "ignore_eos"), decoding_mode=mode)


def parse_completion(body: dict) -> SamplingRequest:
    req = _common(body, chat=False)
    req.prompt = _prompt(body.get("prompt"))
    return req


def _prompt(p: Any) -> Union[str, list[int]]:
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        if not p:
            raise bad_value("prompt", "'prompt' is empty; send at least one character.")
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return list(p)
    if isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
        raise unsupported("prompt", f"a batch of {len(p)} prompts; send one prompt per request.")
    raise bad_value("prompt", "'prompt' must be a non-empty string or a non-empty list of token ids.")


def parse_chat(body: dict) -> SamplingRequest:
    req = _common(body, chat=True)
    req.messages = _messages(body.get("messages"))
    return req


def _messages(msgs: Any) -> list[dict]:
    if not isinstance(msgs, list) or not msgs:
        raise bad_value("messages", "'messages' must be a non-empty list of {\"role\", \"content\"} objects.")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_value(where, f"'{where}' must be an object with 'role' and 'content'.")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise bad_value(f"{where}.role", f"'{where}.role' must be one of {', '.join(CHAT_ROLES)}, got "
                                             f"{json.dumps(role)}.")
        out.append({"role": "system" if role == "developer" else role, "content": _content(m.get("content"), where)})
    if out[-1]["role"] == "assistant":
        raise bad_value("messages", "the last message is the assistant's; end the conversation with a user message.")
    return out


def _content(c: Any, where: str) -> str:
    if isinstance(c, str):
        return c
    if isinstance(c, list) and all(isinstance(p, dict) for p in c):
        kinds = {p.get("type") for p in c}
        if kinds <= {"text"} and all(isinstance(p.get("text"), str) for p in c):
            return "".join(p["text"] for p in c)
        raise unsupported(f"{where}.content", f"content parts of type {sorted(map(str, kinds - {'text'}))}; only "
                                              f"text is understood.")
    raise bad_value(f"{where}.content", f"'{where}.content' must be a string or a list of text parts.")


# ---- responses ---------------------------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: Optional[int] = None) -> dict:
    """OpenAI's usage; `cached_tokens` (prompt tokens served from the KV prefix cache) as OpenAI's
    `prompt_tokens_details.cached_tokens`, where the engine reported it."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def completion_body(rid: str, created: int, model: str, text: str, finish_reason: str, use: dict,
                    redrafter: dict, logprobs: Optional[dict] = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "system_fingerprint": None,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
            "usage": use, "redrafter": redrafter}


def chat_body(rid: str, created: int, model: str, text: str, finish_reason: str, use: dict, redrafter: dict,
              logprobs: Optional[dict] = None) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "system_fingerprint": None,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                         "logprobs": logprobs, "finish_reason": finish_reason}],
            "usage": use, "redrafter": redrafter}


def completion_chunk(rid: str, created: int, model: str, text: str, finish_reason: Optional[str],
                     logprobs: Optional[dict] = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "system_fingerprint": None,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}


def chat_chunk(rid: str, created: int, model: str, delta: dict, finish_reason: Optional[str],
               logprobs: Optional[dict] = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}


@dataclass
class LoggedToken:
    """One output token as the logprobs fields show it: its text and bytes, its log-probability, and the most likely
    tokens at its position ((text, bytes, log-probability), best first)."""

    text: str
    bytes: bytes
    logprob: float
    top: list[tuple[str, bytes, float]] = field(default_factory=list)


def chat_logprobs(tokens: list[LoggedToken]) -> dict:
    """OpenAI chat's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}], "refusal": null}."""
    def entry(text: str, raw: bytes, lp: float) -> dict:
        return {"token": text, "logprob": lp, "bytes": list(raw)}

    return {"content": [{**entry(t.text, t.bytes, t.logprob), "top_logprobs": [entry(*x) for x in t.top]}
                        for t in tokens], "refusal": None}


def completion_logprobs(tokens: list[LoggedToken], text_offset: int) -> dict:
    """OpenAI completions' `logprobs`: parallel lists tokens, token_logprobs, top_logprobs ({token: logprob}) and
    text_offset (each token's offset in the output text, from `text_offset`)."""
    offsets, at = [], text_offset
    for t in tokens:
        offsets.append(at)
        at += len(t.text)
    return {"tokens": [t.text for t in tokens], "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{text: lp for text, _, lp in t.top} for t in tokens], "text_offset": offsets}


def usage_chunk(chunk: dict, use: dict, redrafter: dict) -> dict:
    """The last chunk of a stream with stream_options.include_usage: no choices, the usage and our statistics."""
    return {**chunk, "choices": [], "usage": use, "redrafter": redrafter}


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
