"""Serving through a real tritonserver (CPU): streaming parity with offline generation, in-flight batching of
32 concurrent streams, cancellation, malformed requests, Prometheus metrics, TP=2 == TP=1, clean shutdown, and the
preprocessing model's chat template (`generate --chat`).

The server is nvidia-pytriton's bundled tritonserver (or a system one), started by `serving.launcher`.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from engine_utils import build_tiny_engines, load_engine, stub_crashes, write_chat_tokenizer
from trt_redrafter.chat import chat_prompt_ids
from trt_redrafter.cli import main as cli
from trt_redrafter.config import SamplingConfig
from trt_redrafter.errors import UserError
from trt_redrafter.runtime.distributed import free_port
from trt_redrafter.runtime.generate import generate
from trt_redrafter.serving import ENGINE_MODEL
from trt_redrafter.serving.engine_model import parse_inputs
from trt_redrafter.serving.metrics import scrape, sum_metric
from trt_redrafter.config import RuntimeConfig
from trt_redrafter.serving.repo import make_repo
from trt_redrafter.serving.text import REPLACEMENT, TextCodec, load_tokenizer

CHAT_TOKENIZER = "chat-tokenizer"  # beside the repositories (the `engines` fixture)
PROMPTS = ["The quick brown fox", "Hello world, this is", "import os", "def main():", "a b c d e f g",
           "Once upon a time", "x", "Serving ReDrafter with Triton"]


# ---- unit tests of the engine model's request parsing (no server) ----------------------------------------------
def _inputs(**kw):
    base = {"input_ids": np.array([[5, 6, 7]], np.int32), "request_output_len": np.array([[4]], np.int32)}
    base.update(kw)
    return base


def test_parse_inputs_maps_tensorrt_llm_names():
    p = parse_inputs(_inputs(temperature=np.array([[0.5]], np.float32), runtime_top_k=np.array([[3]], np.int32),
                             runtime_top_p=np.array([[0.9]], np.float32), seed=np.array([[7]], np.uint64),
                             end_id=np.array([[2]], np.int32), streaming=np.array([[True]]),
                             input_lengths=np.array([[2]], np.int32),
                             stop_words_list=np.array([[[9, 8, 4], [2, 3, -1]]], np.int32)))
    assert p.spec.prompt == [5, 6] and p.spec.params.max_tokens == 4 and p.streaming
    assert (p.spec.params.temperature, p.spec.params.top_k, p.spec.params.top_p, p.spec.params.seed) == \
        (0.5, 3, pytest.approx(0.9), 7)
    assert p.spec.stop_ids == (2,) and p.spec.stop_sequences == ((9, 8), (4,))
    assert p.spec.cache_salt == "" and parse_inputs(_inputs(cache_salt=np.array([[b"Tenant A"]], dtype=object))
                                                    ).spec.cache_salt == "Tenant A"
    assert parse_inputs(_inputs(end_id=np.array([[-1]], np.int32))).spec.stop_ids == ()


@pytest.mark.parametrize("kw, match", [
    ({"request_output_len": np.array([[0]], np.int32)}, "max_tokens must be a positive integer"),
    ({"input_ids": np.zeros((1, 0), np.int32)}, "prompt is empty"),
    ({"beam_width": np.array([[2]], np.int32)}, "beam_width=2 is not supported"),
    ({"runtime_top_k": np.array([[-1]], np.int32)}, "bad sampling parameters"),
    ({"seed": np.array([[2**63]], np.uint64)}, r"seed: expected an integer in \[0, 2\*\*63\)"),  # crashed the step
    ({"input_ids": np.array([[1], [2]], np.int32)}, "one prompt per request"),
])
def test_parse_inputs_refusals(kw, match):
    with pytest.raises(UserError, match=match):
        parse_inputs(_inputs(**kw))


# ---- the server --------------------------------------------------------------------------------------------------
def _require_server():
    pytest.importorskip("tritonclient.grpc", reason="tritonclient is not installed (pip install '.[serving]')")
    from trt_redrafter.serving.launcher import find_tritonserver

    try:
        find_tritonserver()
    except UserError as e:
        pytest.skip(f"no tritonserver binary: {e}")


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    _require_server()
    root = tmp_path_factory.mktemp("serving")
    _, engines = build_tiny_engines(root, seed=11, num_beams=2, draft_len=2, tps=(1, 2), max_batch_size=8,
                                    max_seq_len=160)
    repos = {}
    # the TP1 server's tokenizer has a chat template (the TP2 one has none); plain text encodes the same with both
    chat_tokenizer = write_chat_tokenizer(engines[1] / "tokenizer", root / CHAT_TOKENIZER)
    for tp, engine_dir in engines.items():
        repos[tp] = root / f"repo-tp{tp}"
        # eager: these tests check the protocol, and compiling costs ~a minute per server start on 2 cores (the
        # CI perf smoke serves compiled engines)
        make_repo(engine_dir, repos[tp], tokenizer_dir=chat_tokenizer if tp == 1 else None,
                  runtime=RuntimeConfig(compile="off", speculate="full"))
    return engines, repos


def _server(repo: Path):
    from trt_redrafter.serving.launcher import TritonServer

    return TritonServer(repo, grpc_port=free_port(), http_port=free_port(), metrics_port=free_port())


def _assert_clean(server, pgid: int) -> None:
    from trt_redrafter.serving.launcher import group_members

    assert group_members(pgid) == [], "tritonserver, stub or follower processes outlived the server"
    assert not list(Path("/dev/shm").glob(f"{server.shm_prefix}*")), "shm regions outlived the server"
    left = subprocess.run(["pgrep", "-f", f"trt_redrafter.serving.follower --engine {server.repo.parent}"],
                          capture_output=True, text=True).stdout.split()
    assert left == [], f"follower ranks left running: {left}"


@pytest.fixture(scope="module")
def server(engines):
    _, repos = engines
    srv = _server(repos[1]).start()
    pgid = srv.proc.pid
    yield srv
    from trt_redrafter.serving.launcher import kernel_log, stub_processes

    stubs, klog = set(stub_processes(pgid)), kernel_log()
    report = srv.stop()
    assert report["returncode"] == 0 and report["killed"] == [], report
    _assert_clean(srv, pgid)
    # tritonserver exits 0 and logs nothing when a stub segfaults while unloading; only the kernel log shows it
    # (the metric families' teardown, ServingMetrics.release). Unchecked where dmesg is not readable.
    assert stubs, "no Python-backend stub process was found in the server's process group"
    crashes = stub_crashes(klog, stubs)
    assert not crashes, f"a Python-backend stub crashed at shutdown: {crashes}"


@pytest.fixture(scope="module")
def codec(engines):
    return TextCodec(engines[0][1] / "tokenizer")


@pytest.fixture(scope="module")
def offline(engines):
    """Greedy outputs of the same engine, in process, stopping at EOS like the server's default end_id."""
    engine = load_engine(engines[0][1])
    codec = TextCodec(engines[0][1] / "tokenizer")

    def run(prompts: list[str | list[int]], max_tokens: list[int]) -> list[list[int]]:
        res = generate(engine, [p if isinstance(p, list) else codec.encode(p) for p in prompts],
                       [SamplingConfig(max_tokens=n) for n in max_tokens], stop_ids=(codec.end_id,))
        return [r.output_ids for r in res]

    return run


def _idle(srv, timeout: float = 5.0) -> dict:
    """Wait until no request runs or waits and no KV block is used; return the metrics."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(srv.metrics_url)
        busy = sum(sum_metric(m, f"trt_redrafter_{k}") for k in ("kv_blocks_used", "active_requests",
                                                                  "waiting_requests"))
        if busy == 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def _gen(srv, prompt, max_tokens, **kw):
    from trt_redrafter.serving.client import GenerationRequest, generate_one

    model = kw.pop("model", "ensemble")
    opts = {k: kw.pop(k) for k in ("request_id", "cancel_after", "on_chunk") if k in kw}
    return generate_one(srv.grpc_url, GenerationRequest(prompt=prompt, max_tokens=max_tokens, **kw), model=model,
                        timeout=120, **opts)


@pytest.mark.server
@pytest.mark.core
def test_stream_matches_offline_generation(server, offline, codec):
    want = offline(PROMPTS[:2], [40, 40])
    for prompt, ids in zip(PROMPTS[:2], want):
        out = _gen(server, prompt, 40, stream=True)
        assert out.error is None and out.final
        assert out.output_ids == ids
        assert len(out.chunks) > 1  # one response per step
        assert out.text == codec.decode(ids).rstrip(REPLACEMENT)
        assert out.stats["total_draft_tokens"] > 0 and 0.0 <= out.stats["acceptance_rate"] <= 1.0
    single = _gen(server, PROMPTS[0], 40, stream=False)  # one response with everything
    assert single.final and len(single.chunks) == 1 and single.output_ids == want[0]


@pytest.mark.server
def test_log_probs_come_back_in_tensorrt_llms_tensors(engines, server, codec):
    """return_log_probs through the stock ensemble: output_log_probs holds every output token's so far in each
    streamed response (TensorRT-LLM's layout) and cum_log_probs their sum; the numbers are the engine's, which
    test_logprobs.py checks against Hugging Face."""
    ids = codec.encode(PROMPTS[0])
    want = generate(load_engine(engines[0][1]), [ids], SamplingConfig(max_tokens=30, logprobs=True),
                    stop_ids=(codec.end_id,))[0]
    lps = [t.logprob for t in want.logprobs]
    out = _gen(server, PROMPTS[0], 30, stream=True, return_log_probs=True)
    assert out.error is None and out.output_ids == want.output_ids and len(out.chunks) > 2
    n = 0
    for c in out.chunks:
        if c.output_ids:
            n += len(c.output_ids)
            np.testing.assert_allclose(c.log_probs, lps[:n], atol=1e-5)
            assert c.cum_log_prob == pytest.approx(sum(lps[:n]), abs=1e-4)
    single = _gen(server, PROMPTS[0], 30, stream=False, return_log_probs=True)
    np.testing.assert_allclose(single.chunks[0].log_probs, lps, atol=1e-5)
    assert _gen(server, PROMPTS[0], 4, stream=True).chunks[0].log_probs == []  # only when asked


@pytest.mark.server
def test_proposer_input_reaches_the_engine_through_the_ensemble(server, offline):
    want = offline(PROMPTS[:2], [30, 30])
    for proposer in ("ngram", "mixed", "redrafter"):
        for prompt, ids in zip(PROMPTS[:2], want):
            out = _gen(server, prompt, 30, stream=True, proposer=proposer)
            assert out.error is None and out.output_ids == ids, proposer
    bad = _gen(server, PROMPTS[0], 4, proposer="eagle")
    assert bad.error is not None and "proposer must be one of redrafter, ngram, mixed" in bad.error


@pytest.mark.server
def test_32_concurrent_streams_batch_in_flight(server, offline):
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(32)]
    lengths = [8 + (7 * i) % 33 for i in range(32)]
    want = offline(prompts, lengths)
    outs: list = [None] * 32
    waiting_seen = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            waiting_seen.append(sum_metric(scrape(server.metrics_url), "trt_redrafter_waiting_requests"))
            time.sleep(0.05)

    def one(i):
        outs[i] = _gen(server, prompts[i], lengths[i], stream=True)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        stop.set()
        watcher.join()
    for i, out in enumerate(outs):
        assert out.error is None and out.final, (i, out.error)
        assert out.output_ids == want[i], i
    assert max(waiting_seen) > 0  # max_batch_size 8 < 32: requests queued, then joined running ones
    m = _idle(server)
    assert sum_metric(m, "trt_redrafter_kv_blocks_used") == 0
    assert sum_metric(m, "trt_redrafter_kv_blocks_total") > 0
    assert sum_metric(m, "trt_redrafter_tokens_per_step_count") > 0


@pytest.mark.server
def test_cancellation_frees_the_request(server, codec, offline):
    before = sum_metric(scrape(server.metrics_url), 'trt_redrafter_requests_total{model="tensorrt_llm",'
                                                    'outcome="cancelled"}')
    # client cancellation, straight to the engine model
    out = _gen(server, "", 150, model=ENGINE_MODEL, prompt_ids=codec.encode("cancel me"), end_id=-1, stream=True,
               cancel_after=3)
    assert out.error == "cancelled" and len(out.output_ids) < 150
    m = _idle(server, timeout=2.0)
    assert sum_metric(m, "trt_redrafter_kv_blocks_used") == 0 and sum_metric(m, "trt_redrafter_active_requests") == 0
    # client cancellation through the ensemble: Triton does not cancel the running engine step, postprocessing sees
    # the next step cancelled and sends the engine the request's key (without it the engine runs all 150 tokens)
    generated = sum_metric(m, "trt_redrafter_generated_tokens_total")
    out = _gen(server, "cancel me", 150, end_id=-1, stream=True, cancel_after=1)
    assert out.error == "cancelled"
    cancelled = 'trt_redrafter_requests_total{model="tensorrt_llm",outcome="cancelled"}'
    deadline = time.monotonic() + 10  # the gauges lag by up to 100 ms; the counter moves when the engine ends it
    while sum_metric(m := scrape(server.metrics_url), cancelled) < before + 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sum_metric(m, cancelled) == before + 2
    m = _idle(server, timeout=5.0)
    assert sum_metric(m, "trt_redrafter_generated_tokens_total") - generated < 150
    assert sum_metric(m, "trt_redrafter_kv_blocks_used") == 0 and sum_metric(m, "trt_redrafter_active_requests") == 0
    # TensorRT-LLM's stop request (same request_id, stop=true) through the ensemble
    from trt_redrafter.serving.client import send_stop

    first = threading.Event()
    res = {}
    t = threading.Thread(target=lambda: res.update(out=_gen(server, "stop me", 150, end_id=-1, stream=True,
                                                            request_id="to-stop", on_chunk=lambda c: first.set())))
    t.start()
    assert first.wait(30)
    send_stop(server.grpc_url, "to-stop")
    t.join(30)
    assert res["out"].final and res["out"].error is None and len(res["out"].output_ids) < 150
    m = _idle(server, timeout=2.0)
    assert sum_metric(m, "trt_redrafter_kv_blocks_used") == 0
    assert sum_metric(m, 'trt_redrafter_requests_total{model="tensorrt_llm",outcome="cancelled"}') == before + 3
    # and the server keeps serving
    assert _gen(server, PROMPTS[0], 12).output_ids == offline(PROMPTS[:1], [12])[0]


@pytest.mark.server
@pytest.mark.core
def test_malformed_requests_get_clear_errors(server, offline):
    import tritonclient.grpc as grpcclient

    from trt_redrafter.serving.client import _tensor

    def raw(inputs, model="ensemble"):
        errors = []
        done = threading.Event()
        c = grpcclient.InferenceServerClient(server.grpc_url)
        c.start_stream(callback=lambda result, error: (errors.append(error), done.set()))
        c.async_stream_infer(model, inputs, request_id="bad", enable_empty_final_response=True)
        assert done.wait(30)
        c.stop_stream()
        c.close()
        return str(errors[0])

    text = _tensor("text_input", np.array([[b"hello"]], dtype=object))
    # every input is declared optional (config.pbtxt); preprocessing refuses the request that lacks max_tokens
    assert "max_tokens (preprocessing's REQUEST_OUTPUT_LEN) is missing" in raw([text])
    assert "'max_tokens' data-type is 'FP32'" in raw([text, _tensor("max_tokens", np.array([[4.0]], np.float32))])
    cases = {
        ("hello", 0): "max_tokens must be a positive integer, got 0",
        ("hello", 10_000): "exceeds the engine's max_seq_len=160",
        ("hello " * 100, 4): "max_input_len is 64",
        ("", 4): "text_input is empty",
    }
    for (prompt, n), msg in cases.items():
        out = _gen(server, prompt, n)
        assert out.error is not None and msg in out.error, (prompt[:10], n, out.error)
    import tritonclient.grpc as g

    assert g.InferenceServerClient(server.grpc_url).is_server_ready()
    assert _gen(server, PROMPTS[2], 10).output_ids == offline(PROMPTS[2:3], [10])[0]


@pytest.mark.server
def test_preprocessing_applies_the_chat_template_when_asked(engines, server, offline, codec, capsys):
    """Through the real tritonserver, whose tokenizer has a Llama-2-style template (BOS written by the template):
    the preprocessing model's INPUT_ID with and without APPLY_CHAT_TEMPLATE, then `generate --chat` end to end."""
    import tritonclient.grpc as grpcclient

    from trt_redrafter.serving.client import _tensor

    chat_tok = load_tokenizer(engines[1][1].parent / CHAT_TOKENIZER)
    prompt = PROMPTS[0]
    want = chat_prompt_ids(chat_tok, prompt)
    assert want[0] == chat_tok.bos_token_id and want[1] != chat_tok.bos_token_id

    def preprocess(flag) -> list[int]:
        inputs = [_tensor("QUERY", np.array([[prompt.encode()]], dtype=object)),
                  _tensor("REQUEST_OUTPUT_LEN", np.array([[8]], np.int32))]  # required, as in TensorRT-LLM's model
        if flag is not None:
            inputs.append(_tensor("APPLY_CHAT_TEMPLATE", np.array([[flag]], bool)))
        c = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            return c.infer("preprocessing", inputs).as_numpy("INPUT_ID").reshape(-1).tolist()
        finally:
            c.close()

    assert preprocess(True) == want
    assert preprocess(False) == preprocess(None) == codec.encode(prompt)  # clients that do not ask: unchanged
    assert cli(["generate", "--url", server.grpc_url, "--prompt", prompt, "--chat", "--max-tokens", "12",
                "--json"]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    chat_out, plain_out = offline([want, prompt], [12, 12])
    assert doc["error"] is None and doc["output_ids"] == chat_out
    assert chat_out != plain_out  # the template changed what the engine saw


@pytest.mark.server
@pytest.mark.mpi
def test_tp2_serving_matches_tp1(engines, server):
    _, repos = engines
    want = [_gen(server, p, 24).output_ids for p in PROMPTS[:3]]
    srv = _server(repos[2])
    with srv:
        pgid = srv.proc.pid
        got = [_gen(srv, p, 24).output_ids for p in PROMPTS[:3]]
    _assert_clean(srv, pgid)
    assert got == want
