"""The OpenAI-compatible API (`trt-redrafter serve --openai-port`, trt_redrafter/serving/openai_api/).

Without a server: request checking, stop strings, incremental detokenization, the Vicuna conversation layout.
With one (`-m server`): the real `trt-redrafter serve` CLI with tritonserver and the frontend, queried with the
official `openai` client: completions and chat, streamed and not, greedy text == the offline AR engine's, usage
counts, the ReDrafter statistics == the offline engine's, stop strings, sampling with a seed, errors in OpenAI's
shape, a client that goes away cancelling its Triton request, Triton unreachable (503), ports in use, and nothing
left running after SIGINT.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

import pytest

from engine_utils import build_tiny_engines, load_engine, random_prompts, write_chat_tokenizer
from trt_redrafter.chat import chat_ids, vicuna_conversation, vicuna_prompt
from trt_redrafter.cli import main as cli
from trt_redrafter.config import MAX_SEED, RuntimeConfig, SamplingConfig
from trt_redrafter.errors import UserError
from trt_redrafter.runtime.distributed import free_port
from trt_redrafter.runtime.generate import generate
from trt_redrafter.serving.metrics import parse_prometheus, scrape, sum_metric
from trt_redrafter.serving.openai_api.generation import Generation, StopMatcher, Step
from trt_redrafter.serving.openai_api.protocol import APIError, parse_chat, parse_completion, parse_json_body
from trt_redrafter.serving.repo import make_repo
from trt_redrafter.serving.text import REPLACEMENT, IncrementalDecoder, TextCodec, load_tokenizer

MODEL = "tiny-redrafter"
PROMPTS = ["The quick brown fox", "Serving ReDrafter with Triton"]
MAX_TOKENS = 24


# ---- request checking (no server) --------------------------------------------------------------------------------
def test_completion_defaults_follow_openai():
    r = parse_completion({"model": "m", "prompt": "hi"})
    assert (r.max_tokens, r.temperature, r.top_p, r.top_k, r.stop, r.stream) == (16, 1.0, 1.0, 0, (), False)
    assert 0 <= r.seed < MAX_SEED and parse_completion({"model": "m", "prompt": "hi"}).seed != r.seed  # drawn
    assert parse_completion({"model": "m", "prompt": "hi", "seed": -1}).seed == MAX_SEED - 1
    assert parse_completion({"model": "m", "prompt": ["hi"]}).prompt == "hi"
    assert parse_completion({"model": "m", "prompt": [[5, 6]]}).prompt == [5, 6]
    assert parse_completion({"model": "m", "prompt": "hi", "stop": "\n"}).stop == ("\n",)
    c = parse_chat({"model": "m", "messages": [{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                                                {"type": "text", "text": "b"}]},
                                               {"role": "user", "content": "q"}],
                    "max_completion_tokens": 7, "stream": True, "stream_options": {"include_usage": True}})
    assert c.messages == [{"role": "system", "content": "ab"}, {"role": "user", "content": "q"}]
    assert (c.max_tokens, c.stream, c.include_usage) == (7, True, True)
    assert parse_chat({"model": "m", "messages": [{"role": "user", "content": "q"}]}).max_tokens is None


@pytest.mark.parametrize("body, param, match", [
    ({"prompt": "x"}, "model", "'model' is required"),
    ({"model": "m", "prompt": "x", "temperature": 3}, "temperature", r"must be in \[0, 2\], got 3"),
    ({"model": "m", "prompt": "x", "temperature": "hot"}, "temperature", "must be a number"),
    ({"model": "m", "prompt": "x", "top_p": 0}, "top_p", r"must be in \(0, 1\]"),
    ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens", "at least 1"),
    ({"model": "m", "prompt": "x", "max_tokens": True}, "max_tokens", "must be an integer"),
    ({"model": "m", "prompt": "x", "n": 2}, "n", "one output per request"),
    ({"model": "m", "prompt": "x", "best_of": 3}, "best_of", "one output per request"),
    ({"model": "m", "prompt": "x", "logprobs": 21}, "logprobs", "at most 20"),
    ({"model": "m", "prompt": "x", "logprobs": True}, "logprobs", "must be an integer"),
    ({"model": "m", "prompt": "x", "echo": True}, "echo", "not echoed"),
    ({"model": "m", "prompt": "x", "presence_penalty": 0.5}, "presence_penalty", "no penalties"),
    ({"model": "m", "prompt": "x", "stop": [1]}, "stop", "a string or a list of strings"),
    ({"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "only allowed"),
    ({"model": "m", "prompt": ["a", "b"]}, "prompt", "a batch of 2 prompts"),
    ({"model": "m", "prompt": ""}, "prompt", "empty"),
    ({"model": "m", "prompt": "x", "decoding_mode": "medusa"}, "decoding_mode", "one of redrafter, ar"),
    ({"model": "m", "prompt": "x", "cache_salt": ""}, "cache_salt", "non-empty string"),
])
def test_completion_refusals_name_the_field(body, param, match):
    with pytest.raises(APIError, match=match) as e:
        parse_completion(body)
    assert e.value.status == 400 and e.value.param == param
    assert set(e.value.body()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("messages, param", [
    ([], "messages"), ("hi", "messages"), ([{"role": "robot", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages[0].content"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "messages"),
])
def test_chat_refusals_name_the_field(messages, param):
    with pytest.raises(APIError) as e:
        parse_chat({"model": "m", "messages": messages})
    assert e.value.status == 400 and e.value.param == param


def test_logprob_fields_parse_as_openai_defines_them():
    user = [{"role": "user", "content": "q"}]
    c = parse_chat({"model": "m", "messages": user, "logprobs": True, "top_logprobs": 5})
    assert (c.logprobs, c.top_logprobs) == (True, 5)
    assert (parse_chat({"model": "m", "messages": user}).logprobs, parse_completion({"model": "m", "prompt": "x"})
            .logprobs) == (False, False)
    d = parse_completion({"model": "m", "prompt": "x", "logprobs": 0})  # the chosen tokens', no alternatives
    assert (d.logprobs, d.top_logprobs) == (True, 0)
    for body, match in (({"top_logprobs": 2}, "needs 'logprobs': true"), ({"logprobs": True, "top_logprobs": 21},
                                                                           "at most 20"),
                        ({"logprobs": 1}, "must be true or false")):
        with pytest.raises(APIError, match=match) as e:
            parse_chat({"model": "m", "messages": user, **body})
        assert e.value.status == 400


def test_token_bytes_are_the_tokens_own(tiny_codec):
    """OpenAI's `bytes` of a byte-level BPE token: its raw bytes, which may be part of a UTF-8 character; the pieces
    of a text add up to its UTF-8 encoding."""
    text = "héllo wörld — ✓ 日本語"
    ids = tiny_codec.encode(text)[1:]
    assert b"".join(tiny_codec.token_bytes(t) for t in ids) == text.encode()
    assert any(REPLACEMENT in tiny_codec.token_text(t) for t in ids)  # a token inside a character


def test_malformed_json():
    for raw in (b"{bad", b"[1]", b"\xff"):
        with pytest.raises(APIError, match="JSON") as e:
            parse_json_body(raw)
        assert e.value.status == 400 and e.value.code == "invalid_json"


# ---- stop strings, detokenization, one generation (no server) ----------------------------------------------------
def test_stop_matcher_holds_back_what_may_start_a_stop_string():
    m = StopMatcher(("STOP", "\n\n"))
    assert m.push("abc ST") == "abc " and m.pending == "ST"
    assert m.push("X") == "STX"  # not a stop string after all
    assert m.push("de\n") == "de" and m.push("\n") == "" and m.hit  # across pieces
    assert m.push("more") == ""
    m = StopMatcher(("xyz", "b"))
    assert m.push("aaxyzab") == "aa" and m.hit  # the first occurrence of any of them
    m = StopMatcher(("END",))
    assert m.push("the EN") == "the " and m.flush() == "EN"  # at the end of the output it is text
    assert StopMatcher(()).push("EN") == "EN"


@pytest.fixture(scope="module")
def tiny_codec(tiny_pair) -> TextCodec:
    return TextCodec(tiny_pair / "base")  # byte-level BPE: tokens may end inside a UTF-8 character


def test_incremental_decoder_pieces_add_up_to_the_whole(tiny_codec):
    import random

    rng = random.Random(0)
    for ids in ([rng.randrange(3, 384) for _ in range(60)], tiny_codec.encode("héllo wörld — ✓ 日本語 ok")[1:]):
        dec = IncrementalDecoder(tiny_codec)
        pieces = [dec.push(t) for t in ids] + [dec.flush()]
        assert "".join(pieces) == tiny_codec.decode(ids)
    dec = IncrementalDecoder(tiny_codec)
    text = "日本"
    pieces = [dec.push(t) for t in tiny_codec.encode(text)[1:]]
    assert "".join(pieces) == text and not any(REPLACEMENT in p for p in pieces)  # never half a character


def test_generation_cuts_at_a_stop_string_and_counts_tokens_to_it(tiny_codec):
    ids = tiny_codec.encode("one two three four")[1:]
    gen = Generation(tiny_codec, stops=("three",), end_id=tiny_codec.end_id)
    n_to_stop = next(n for n in range(1, len(ids) + 1) if "three" in tiny_codec.decode(ids[:n]))
    texts = [gen.on_step(Step(ids[:3], accepted_draft_tokens=0, draft_tokens=4)),
             gen.on_step(Step(ids[3:], accepted_draft_tokens=2, draft_tokens=8, acceptance_rate=0.25))]
    assert "".join(texts) == gen.text == "one two " and gen.finish_reason == "stop"
    assert gen.completion_tokens == n_to_stop < len(ids)
    assert gen.stats.as_dict() == {"accepted_draft_tokens": 2, "draft_tokens": 8, "acceptance_rate": 0.25,
                                   "generation_steps": 1, "tokens_per_step": len(ids) - 3}
    eos = Generation(tiny_codec, end_id=tiny_codec.end_id)
    assert eos.on_step(Step(ids + [tiny_codec.end_id], final=True)) == "one two three four"
    assert eos.finish_reason == "stop" and eos.completion_tokens == len(ids) + 1
    length = Generation(tiny_codec, end_id=tiny_codec.end_id)
    length.on_step(Step(ids[:2]))
    length.finish()  # the engine's stream ended: max_tokens
    assert length.finish_reason == "length" and length.text == tiny_codec.decode(ids[:2])


def test_vicuna_conversation_layout():
    assert vicuna_conversation([{"role": "user", "content": "hi"}]) == vicuna_prompt("hi")
    assert vicuna_conversation([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a"},
                                {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]) \
        == "Be brief. USER: a ASSISTANT: b</s>USER: c ASSISTANT:"


def test_repo_parameter_reads_pbtxt_strings(tmp_path):
    from trt_redrafter.serving.repo import repo_parameter

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.pbtxt").write_text(
        'parameters { key: "gpt_model_path" value: { string_value: "/e/x" } }\n'
        'parameters {\n  key: "runtime_config"\n  value: { string_value: "{\\"a\\": 1}" }\n}\n')
    assert repo_parameter(tmp_path, "m", "gpt_model_path") == "/e/x"
    assert repo_parameter(tmp_path, "m", "runtime_config") == '{"a": 1}'
    assert repo_parameter(tmp_path, "m", "engine_dir") is None and repo_parameter(tmp_path, "x", "y") is None


# ---- the real server ---------------------------------------------------------------------------------------------
def _require_server():
    pytest.importorskip("tritonclient.grpc", reason="tritonclient is not installed (pip install '.[serving]')")
    for mod in ("fastapi", "uvicorn", "openai"):
        pytest.importorskip(mod, reason=f"{mod} is not installed (pip install '.[dev,serving]')")
    from trt_redrafter.serving.launcher import find_tritonserver

    try:
        find_tritonserver()
    except UserError as e:
        pytest.skip(f"no tritonserver binary: {e}")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """A tiny engine and its repository, whose tokenizer has a Llama-2-style chat template."""
    _require_server()
    root = tmp_path_factory.mktemp("openai")
    _, engines = build_tiny_engines(root, seed=11, num_beams=2, draft_len=2, tps=(1,), max_batch_size=4,
                                    max_seq_len=160, kv_block_size=16)
    tokenizer = write_chat_tokenizer(engines[1] / "tokenizer", root / "chat-tokenizer")
    make_repo(engines[1], root / "repo", tokenizer_dir=tokenizer, runtime=RuntimeConfig(compile="off", speculate="full"))
    return engines[1], root / "repo", tokenizer


def _get(url: str, timeout: float = 2.0) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _processes_of(repo: Path) -> list[str]:
    return subprocess.run(["pgrep", "-f", str(repo)], capture_output=True, text=True).stdout.split()


@contextlib.contextmanager
def _serve(repo: Path, log: Path, extra: tuple[str, ...] = ()):
    """`trt-redrafter serve --openai-port` as a user runs it; SIGINT at the end must leave nothing behind."""
    from trt_redrafter.serving.launcher import package_env

    ports = {k: free_port() for k in ("grpc", "http", "metrics", "openai")}
    cmd = [sys.executable, "-m", "trt_redrafter", "serve", "--repo", str(repo), "--grpc-port", str(ports["grpc"]),
           "--http-port", str(ports["http"]), "--metrics-port", str(ports["metrics"]),
           "--openai-port", str(ports["openai"]), "--openai-model-name", MODEL, *extra]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=package_env(), stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{ports['openai']}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if _get(f"{base}/health")[0] == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None, f"serve exited {proc.returncode}:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"not ready in 300 s:\n{log.read_text()[-3000:]}"
            time.sleep(0.2)
        yield {"base": base, "ports": ports, "pid": proc.pid, "log": log, "proc": proc}
    finally:
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=90)
    text = log.read_text()
    assert rc == 0 and text.rstrip().endswith("stopped"), text[-3000:]
    # tritonserver unloaded every model in time and neither it nor the frontend had to be killed
    assert "Exit timeout expired" not in text and "cleaned up after" not in text, text[-3000:]
    assert _processes_of(repo) == [], "tritonserver, its stub or the OpenAI frontend outlived serve"
    assert not list(Path("/dev/shm").glob(f"trtrd{proc.pid}x*")), "shm regions outlived serve"


@pytest.fixture(scope="module")
def served(engine, tmp_path_factory):
    with _serve(engine[1], tmp_path_factory.mktemp("serve-log") / "serve.log") as s:
        yield s


@pytest.fixture(scope="module")
def client(served):
    import openai

    return openai.OpenAI(base_url=f"{served['base']}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(engine):
    """The same engine in process: (GenerationResult of AR, of ReDrafter) per prompt, both greedy."""
    eng = load_engine(engine[0])

    def run(prompt_ids: list[list[int]], max_tokens: int, stop_ids: tuple[int, ...]):
        sp = SamplingConfig(max_tokens=max_tokens)
        ar = generate(eng, prompt_ids, sp, mode="ar", stop_ids=stop_ids)
        rd = generate(eng, prompt_ids, sp, mode="redrafter", stop_ids=stop_ids)
        assert [r.output_ids for r in rd] == [r.output_ids for r in ar]  # greedy ReDrafter == AR
        return list(zip(ar, rd))

    return run


@pytest.fixture(scope="module")
def codec(engine) -> TextCodec:
    return TextCodec(engine[2])


def _check(text: str, usage, finish_reason: str, stats: dict, prompt_ids: list[int], ar, rd, codec) -> None:
    assert text == codec.decode(ar.output_ids)
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt_ids), len(ar.output_ids))
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert finish_reason == ("stop" if ar.output_ids[-1] == codec.end_id else "length")
    assert (stats["generation_steps"], stats["accepted_draft_tokens"], stats["draft_tokens"]) == \
        (rd.steps, rd.accepted_draft_tokens, rd.draft_tokens)
    assert stats["tokens_per_step"] == pytest.approx(rd.tokens_per_step, abs=1e-5) and stats["draft_tokens"] > 0


@pytest.mark.server
def test_models_and_health(served, client, engine):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert _get(f"{served['base']}/health") == (200, {"status": "ok"})
    from trt_redrafter.serving.openai_api.engine_client import served_model

    m = served_model(engine[1])  # what the frontend read from the repository make-repo wrote
    assert (m.name, m.engine_dir, m.tokenizer_dir, m.max_input_len, m.max_seq_len, m.backend) == \
        (engine[0].name, engine[0], engine[2], 64, 160, "torch")


@pytest.mark.server
@pytest.mark.core
def test_completions_greedy_match_the_offline_engine(client, offline, codec):
    prompt_ids = [codec.encode(p) for p in PROMPTS]
    for prompt, ids, (ar, rd) in zip(PROMPTS, prompt_ids, offline(prompt_ids, MAX_TOKENS, (codec.end_id,))):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        _check(r.choices[0].text, r.usage, r.choices[0].finish_reason, r.redrafter, ids, ar, rd, codec)
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        assert len(chunks) > 3  # one chunk per engine step, not one at the end
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert len(finish) == 1 and chunks[-1].choices == []
        _check(text, chunks[-1].usage, finish[0], chunks[-1].redrafter, ids, ar, rd, codec)
    r = client.completions.create(model=MODEL, prompt=prompt_ids[0], max_tokens=8, temperature=0)  # token ids
    assert r.choices[0].text == codec.decode(offline(prompt_ids[:1], 8, (codec.end_id,))[0][0].output_ids)


@pytest.mark.server
def test_a_repeated_prompt_reports_its_cached_tokens_and_the_same_text(served, client, offline, codec):
    """The second request with a prompt prefills only its last block's tokens from the prefix cache: OpenAI's
    `usage.prompt_tokens_details.cached_tokens` says how many it reused (whole 16-token blocks, never the last
    token), and the text is the first one's, which is the offline engine's."""
    ids = random_prompts(384, [45], seed=21)[0]  # two full blocks reusable, the third holds the last token
    want = codec.decode(offline([ids], 12, (codec.end_id,))[0][0].output_ids)
    first = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    second = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert first.choices[0].text == second.choices[0].text == want
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 32
    salted = [client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0,
                                        extra_body={"cache_salt": "tenant-b"}) for _ in range(2)]
    assert [r.usage.prompt_tokens_details.cached_tokens for r in salted] == [0, 32]  # shared within its salt only
    assert salted[0].choices[0].text == want
    m = _idle(served)  # and /metrics says so: a hit rate between 0 and 1, and TensorRT-LLM's reused-block count
    assert 0 < sum_metric(m, "trt_redrafter_kv_cache_hit_rate") < 1
    url = f"http://127.0.0.1:{served['ports']['metrics']}/metrics"
    stock = parse_prometheus(urllib.request.urlopen(url).read().decode(), prefix="nv_trt_llm_")
    assert sum(v for k, v in stock.items()
               if k.startswith("nv_trt_llm_kv_cache_block_metrics{") and 'kv_cache_block_type="reused"' in k) >= 2


def _logprobs_offline(engine, ids: list[int], n: int, top: int, codec) -> list:
    return generate(load_engine(engine[0]), [ids], SamplingConfig(max_tokens=n, logprobs=True, top_logprobs=top),
                    stop_ids=(codec.end_id,))[0]


@pytest.mark.server
def test_logprobs_through_the_openai_client(client, engine, codec):
    """Chat (`logprobs` + `top_logprobs`) and completions (`logprobs: N`), whole and streamed: the engine's
    log-probabilities (test_logprobs.py checks them against Hugging Face), token texts and bytes."""
    messages = [{"role": "user", "content": "Name three primes."}]
    ids = chat_ids(load_tokenizer(engine[2]), messages)
    want = _logprobs_offline(engine, ids, MAX_TOKENS, 3, codec)
    lps = [t.logprob for t in want.logprobs]
    tops = [[codec.token_text(i) for i, _ in t.top] for t in want.logprobs]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(lps, abs=1e-5)
    assert [c.token for c in content] == [codec.token_text(t) for t in want.output_ids]
    assert [c.bytes for c in content] == [list(codec.token_bytes(t)) for t in want.output_ids]
    assert [[x.token for x in c.top_logprobs] for c in content] == tops
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                                 temperature=0, logprobs=True, top_logprobs=3, stream=True))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [c.logprob for c in streamed] == pytest.approx(lps, abs=1e-5)
    assert sum(1 for ch in chunks if ch.choices and ch.choices[0].logprobs) > 1  # with each step's tokens
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None

    prompt = random_prompts(384, [12], seed=4)[0]
    want = _logprobs_offline(engine, prompt, 10, 2, codec)
    for stream in (False, True):
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, logprobs=2,
                                        stream=stream)
        choices = [ch.choices[0] for ch in out] if stream else out.choices
        got = [x for ch in choices if ch.logprobs for x in ch.logprobs.token_logprobs]
        assert got == pytest.approx([t.logprob for t in want.logprobs], abs=1e-5)
        offsets = [x for ch in choices if ch.logprobs for x in ch.logprobs.text_offset]
        assert offsets[0] == 0 and offsets == sorted(offsets)
        assert all(len(d) <= 2 for ch in choices if ch.logprobs for d in ch.logprobs.top_logprobs)


@pytest.mark.server
@pytest.mark.core
def test_chat_uses_the_models_template_and_matches_offline(client, offline, codec, engine):
    tok = load_tokenizer(engine[2])
    messages = [{"role": "user", "content": "Name three primes."}]
    ids = chat_ids(tok, messages)
    assert ids[0] == tok.bos_token_id and ids != codec.encode(messages[0]["content"])  # the template applied
    (ar, rd), = offline([ids], MAX_TOKENS, (codec.end_id,))
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.object == "chat.completion"
    _check(r.choices[0].message.content, r.usage, r.choices[0].finish_reason, r.redrafter, ids, ar, rd, codec)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    _check(text, chunks[-1].usage, finish[0], chunks[-1].redrafter, ids, ar, rd, codec)
    # no max_tokens: what is left of the engine's context (max_seq_len 160), ignoring EOS here to see all of it
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 160 - len(ids) and r.choices[0].finish_reason == "length"


def _stop_case(codec, ids: list[int]) -> tuple[str, str, int]:
    """(stop string, text before it, tokens up to the one completing it) for an output: the last two characters of
    the text after n tokens, where they first occur there, are printable, and the text so far is the whole text's
    start (no character is incomplete; a random model's bytes may hold invalid ones before, decoded as U+FFFD)."""
    full = codec.decode(ids)
    for n in range(4, len(ids)):
        head = codec.decode(ids[:n])
        stop = head[-2:]
        if (full.startswith(head) and REPLACEMENT not in stop and stop.strip() and stop.isprintable()
                and full.find(stop) == len(head) - 2):
            return stop, head[:-2], n
    raise AssertionError(f"no stop string candidate in {full!r}")


@pytest.mark.server
def test_stop_string_ends_the_text_and_cancels_the_request(served, client, offline, codec):
    prompt = PROMPTS[1]
    (ar, _), = offline([codec.encode(prompt)], MAX_TOKENS, ())
    stop, before, n = _stop_case(codec, ar.output_ids)
    m0 = scrape(f"http://127.0.0.1:{served['ports']['metrics']}/metrics")
    # no max_tokens (what is left of the engine's context): with only MAX_TOKENS - n left, a tiny engine drafting
    # several tokens a step on a busy host can finish a request before the stop string's cancellation reaches it
    kw = dict(model=MODEL, prompt=prompt, temperature=0, stop=[stop, "never-seen"], extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == (before, "stop", n)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == before
    assert chunks[-2].choices[0].finish_reason == "stop" and chunks[-1].usage.completion_tokens == n
    cancelled = 'trt_redrafter_requests_total{model="tensorrt_llm",outcome="cancelled"}'
    # the stop string ends the client's answer at once; the engine's requests are cancelled after it (the model's
    # monitor polls for cancellations), so the count is waited for, not read once the gauges show an idle engine
    m1 = _metrics_when(served, lambda m: sum_metric(m, cancelled) >= sum_metric(m0, cancelled) + 2)
    seen = {k: (m0.get(k), v) for k, v in m1.items() if "requests_total" in k or "generated_tokens" in k}
    assert sum_metric(m1, cancelled) == sum_metric(m0, cancelled) + 2, \
        f"{seen}\nthe server's log ends:\n{served['log'].read_text(errors='replace')[-3000:]}"


@pytest.mark.server
def test_sampling_with_a_seed_repeats(client):
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0.9, top_p=0.95,
              extra_body={"ignore_eos": True, "top_k": 50})
    a, b = (client.completions.create(**kw, seed=1234).choices[0].text for _ in range(2))
    assert a == b
    others = {client.completions.create(**kw, seed=s).choices[0].text for s in (1, 2, 3)}
    assert len(others | {a}) > 1  # the seed changes the samples


@pytest.mark.server
def test_errors_have_openai_shape_and_status(served, client):
    import openai

    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert e.value.status_code == 404 and e.value.code == "model_not_found" and e.value.param == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=3)
    assert e.value.param == "temperature" and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="one output per request"):
        client.completions.create(model=MODEL, prompt="x", n=2)
    with pytest.raises(openai.BadRequestError) as e:  # max_input_len is 64
        client.completions.create(model=MODEL, prompt="word " * 100, max_tokens=2)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:  # the engine's own check, through Triton
        client.completions.create(model=MODEL, prompt=[100_000], max_tokens=2)
    assert e.value.code == "engine_refused" and "outside the vocabulary" in e.value.message
    req = urllib.request.Request(f"{served['base']}/v1/chat/completions", data=b'{"model": ', method="POST")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    body = json.loads(e.value.read())
    assert e.value.code == 400 and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == "invalid_json"
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2)
    assert r.usage.completion_tokens == 2  # and it keeps serving


def _metrics_when(served, ok: Callable[[dict], bool], timeout: float = 30.0) -> dict:
    """The server's metrics once `ok` holds of them (or at the deadline)."""
    url = f"http://127.0.0.1:{served['ports']['metrics']}/metrics"
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        if ok(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def _idle(served) -> dict:
    return _metrics_when(served, lambda m: sum(sum_metric(m, f"trt_redrafter_{k}") for k in (
        "kv_blocks_used", "active_requests", "waiting_requests")) == 0)


@pytest.mark.server
def test_a_client_that_goes_away_cancels_its_triton_request(served, client):
    """~140 tokens take the tiny engine about half a second; both clients leave long before."""
    url = f"http://127.0.0.1:{served['ports']['metrics']}/metrics"
    outcome = 'trt_redrafter_requests_total{{model="tensorrt_llm",outcome="{}"}}'.format

    def wait_for(n_cancelled: int, what: str) -> None:
        deadline = time.monotonic() + 10
        while sum_metric(m := scrape(url), outcome("cancelled")) < n_cancelled:
            assert time.monotonic() < deadline, f"{what}: its Triton request was not cancelled (completed: " \
                                                f"{sum_metric(m, outcome('completed'))})"
            time.sleep(0.05)

    before = sum_metric(_idle(served), outcome("cancelled"))
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=140, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    wait_for(before + 1, "a stream closed after 3 chunks")
    with pytest.raises(Exception):  # a non-streamed answer the client stops waiting for
        client.with_options(timeout=0.05).completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=140,
                                                             extra_body={"ignore_eos": True})
    wait_for(before + 2, "a non-streamed request whose client timed out")
    m = _idle(served)
    assert sum_metric(m, "trt_redrafter_kv_blocks_used") == 0 and sum_metric(m, outcome("cancelled")) == before + 2


@pytest.mark.server
def test_triton_unreachable_is_503_and_ports_in_use_are_refused(served, engine, capsys):
    import openai

    from trt_redrafter.serving.openai_api.process import OpenAIFrontend

    _, repo, _ = engine
    with OpenAIFrontend(repo, f"127.0.0.1:{free_port()}", free_port(), model_name=MODEL) as api:
        c = openai.OpenAI(base_url=api.url, api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert e.value.status_code == 503 and e.value.code == "triton_unavailable"
        assert _get(f"{api.url[:-3]}/health")[0] == 503
    with pytest.raises(UserError, match=f"port {served['ports']['openai']} on 127.0.0.1 .* is in use"):
        OpenAIFrontend(repo, "127.0.0.1:1", served["ports"]["openai"]).start()
    rc = cli(["serve", "--repo", str(repo), "--grpc-port", str(free_port()), "--http-port", str(free_port()),
              "--metrics-port", str(free_port()), "--openai-port", str(served["ports"]["openai"])])
    assert rc == 2
    from trt_redrafter.serving.launcher import default_host  # 0.0.0.0 inside a container, else 127.0.0.1

    assert f"port {served['ports']['openai']} on {default_host()} (--openai-port) is in use" in capsys.readouterr().err


@pytest.mark.server
def test_streaming_from_a_non_decoupled_repository_is_one_chunk(engine, offline, codec, tmp_path):
    """`make-repo --decoupled false` behind `serve --openai-port`: the engine model answers each request once, so a
    streamed completion comes as one chunk holding the whole text (before: a 400), equal to the non-streamed one and
    to the offline engine."""
    import openai

    engine_dir, _, tokenizer = engine
    repo = tmp_path / "repo-unary"
    make_repo(engine_dir, repo, tokenizer_dir=tokenizer, runtime=RuntimeConfig(compile="off", speculate="full"),
              decoupled=False)
    with _serve(repo, tmp_path / "serve.log") as s:
        c = openai.OpenAI(base_url=f"{s['base']}/v1", api_key="x", max_retries=0, timeout=120)
        whole = c.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=12, temperature=0)
        chunks = list(c.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=12, temperature=0,
                                           stream=True))
    texts = [ch.choices[0].text for ch in chunks if ch.choices and ch.choices[0].text]
    assert len(texts) == 1 and texts[0] == whole.choices[0].text, texts
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    ids = codec.encode("The quick brown fox")
    assert whole.choices[0].text == codec.decode(offline([ids], 12, (codec.end_id,))[0][0].output_ids)


@pytest.mark.parametrize("status,coded,want", [
    ("StatusCode.INVALID_ARGUMENT", True, 400),  # a request the client can fix
    ("StatusCode.INTERNAL", True, 503),  # e.g. Triton's "Stub process 'tensorrt_llm_0_0' is not healthy."
    ("StatusCode.UNAVAILABLE", True, 503),  # server busy
    ("StatusCode.INTERNAL", False, 400),  # TensorRT-LLM's backend: its statuses are not relied on
    ("", True, 400),  # an error without a status (what the asyncio stream gives for an engine refusal)
])
def test_engine_errors_map_to_client_or_server_status_with_a_fake_error(status, coded, want):
    """The OpenAI status of an engine error, from its gRPC status (a fake error object and readiness: the real
    statuses come from tritonserver in tests/test_serving_faults.py and test_serving_modes.py)."""
    import asyncio

    from trt_redrafter.serving.openai_api.engine_client import TritonEngine

    class FakeError:
        def status(self):
            return status

        def message(self):
            return "something"

    engine = TritonEngine.__new__(TritonEngine)
    engine.url, engine.model, engine.coded = "localhost:1", "tensorrt_llm", coded

    async def ready():
        return True

    engine.ready = ready
    assert asyncio.run(engine._refused(FakeError())).status == want


def test_structured_output_fields_parse_to_one_guide():
    user = [{"role": "user", "content": "q"}]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    cases = [
        ({"response_format": {"type": "text"}}, (None, None)),
        ({"response_format": {"type": "json_object"}}, ("json", "")),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
         ("json_schema", json.dumps(schema))),
        ({"guided_json": schema}, ("json_schema", json.dumps(schema))),
        ({"guided_regex": "[a-z]+"}, ("regex", "[a-z]+")),
        ({"guided_grammar": 'root ::= "a"'}, ("ebnf_grammar", 'root ::= "a"')),
        ({"guided_choice": ["yes", "no."]}, ("regex", r"(yes|no\.)")),
        ({"structured_outputs": {"regex": "[0-9]"}}, ("regex", "[0-9]")),
    ]
    for extra, want in cases:
        r = parse_chat({"model": "m", "messages": user, **extra})
        assert (r.guide_type, r.guide) == want, extra
    assert parse_completion({"model": "m", "prompt": "x", "guided_regex": "a"}).guide_type == "regex"
    for extra, param in (({"response_format": {"type": "xml"}}, "response_format"),
                         ({"response_format": {"type": "json_schema"}}, "response_format"),
                         ({"guided_choice": []}, "guided_choice"),
                         ({"guided_json": schema, "guided_regex": "a"}, "guided_regex")):
        with pytest.raises(APIError) as e:
            parse_chat({"model": "m", "messages": user, **extra})
        assert e.value.status == 400 and e.value.param == param, extra


GUIDE_SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                                 "tag": {"type": "string", "maxLength": 4}},
                "required": ["id", "tag"], "additionalProperties": False}


@pytest.mark.server
def test_response_format_json_schema_through_the_openai_client(client, engine, codec):
    """A JSON schema as OpenAI's response_format, whole and streamed, ReDrafter and AR: every answer parses and
    validates, the texts agree, and equal the offline engine's constrained output; a bad schema is a 400."""
    import jsonschema
    import openai

    from trt_redrafter.config import Guide

    messages = [{"role": "user", "content": "Describe an item."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "item", "schema": GUIDE_SCHEMA}}
    texts = []
    for mode in ("redrafter", "ar"):
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                           response_format=fmt, extra_body={"decoding_mode": mode})
        texts.append(r.choices[0].message.content)
        assert r.choices[0].finish_reason == "stop"
        stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                                response_format=fmt, stream=True, extra_body={"decoding_mode": mode})
        texts.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
    assert len(set(texts)) == 1, texts
    jsonschema.validate(json.loads(texts[0], strict=False), GUIDE_SCHEMA)
    ids = chat_ids(load_tokenizer(engine[2]), messages)
    want = generate(load_engine(engine[0]), [ids], SamplingConfig(max_tokens=40), stop_ids=(codec.end_id,),
                    guide=Guide.parse("json_schema", json.dumps(GUIDE_SCHEMA)))[0]
    assert codec.decode(want.output_ids) == texts[0]
    short = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0,
                                           response_format=fmt)
    assert short.choices[0].finish_reason == "length" and texts[0].startswith(short.choices[0].message.content)
    with pytest.raises(openai.BadRequestError, match="invalid json_schema guide"):
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "objec"}}})
