"""The engine model's transaction policy and admission limit, through a real tritonserver (CPU):

* `make-repo --decoupled false`: unary gRPC `ModelInfer` and HTTP `infer` on the ensemble and on the engine model
  answer once with the offline AR output (what tensorrtllm_backend's `inflight_batcher_llm_client.py` without
  `--streaming`, and `end_to_end_test.py` / `benchmark_core_model.py` over HTTP, do); a streaming request gets one
  clear error; the stock decoupled repository refuses unary calls as before (Triton's own error).
* `make-repo --max-queue-size N`: at many times what the engine can run, every request is either served (output ==
  offline AR) or refused at once with the busy error; none is lost or hangs, and the KV cache is empty afterwards.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from engine_utils import build_tiny_engines, load_engine
from test_serving import _idle, _require_server, _server
from trt_redrafter.config import RuntimeConfig, SamplingConfig
from trt_redrafter.runtime.generate import generate
from trt_redrafter.serving.metrics import scrape, sum_metric
from trt_redrafter.serving.repo import make_repo
from trt_redrafter.serving.text import TextCodec

PROMPTS = ["The quick brown fox", "import os", "def main():", "Once upon a time"]
QUEUE = 2  # max_queue_size of both repositories
MAX_BATCH = 2


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    _require_server()
    root = tmp_path_factory.mktemp("serving-modes")
    _, engines = build_tiny_engines(root, seed=13, num_beams=2, draft_len=2, tps=(1,), max_batch_size=MAX_BATCH,
                                    max_seq_len=160)
    repos = {}
    for decoupled in (True, False):
        repos[decoupled] = root / f"repo-decoupled-{decoupled}"
        make_repo(engines[1], repos[decoupled], runtime=RuntimeConfig(compile="off"), decoupled=decoupled,
                  max_queue_size=QUEUE)
    codec = TextCodec(engines[1] / "tokenizer")
    engine = load_engine(engines[1])

    def offline(prompts: list[str], max_tokens: int) -> list[list[int]]:
        res = generate(engine, [codec.encode(p) for p in prompts],
                       [SamplingConfig(max_tokens=max_tokens)] * len(prompts), stop_ids=(codec.end_id,))
        return [r.output_ids for r in res]

    return repos, codec, offline


@pytest.fixture(scope="module")
def unary_server(setup):
    srv = _server(setup[0][False]).start()
    yield srv
    report = srv.stop()
    assert report["returncode"] == 0 and report["killed"] == [], report


def _ensemble_inputs(mod, prompt: str, max_tokens: int, stream: bool | None = None):
    """The tensors `inflight_batcher_llm_client.py`-style unary clients send to the ensemble."""
    tensors = [("text_input", np.array([[prompt.encode()]], dtype=object), "BYTES"),
               ("max_tokens", np.array([[max_tokens]], dtype=np.int32), "INT32")]
    if stream is not None:
        tensors.append(("stream", np.array([[stream]], dtype=bool), "BOOL"))
    out = []
    for name, value, dtype in tensors:
        t = mod.InferInput(name, list(value.shape), dtype)
        t.set_data_from_numpy(value)
        out.append(t)
    return out


@pytest.mark.server
def test_unary_grpc_and_http_infer_on_a_non_decoupled_repository(setup, unary_server):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    _, codec, offline = setup
    want = offline(PROMPTS[:2], 16)
    g = grpcclient.InferenceServerClient(unary_server.grpc_url)
    h = httpclient.InferenceServerClient(unary_server.http_url.removeprefix("http://"))
    for prompt, ids in zip(PROMPTS[:2], want):
        r = g.infer("ensemble", _ensemble_inputs(grpcclient, prompt, 16))
        assert r.as_numpy("output_ids").reshape(-1).tolist() == ids
        r = h.infer("ensemble", _ensemble_inputs(httpclient, prompt, 16))
        assert r.as_numpy("output_ids").reshape(-1).tolist() == ids
    # the engine model itself, with token ids (benchmark_core_model.py's tensors)
    ids = codec.encode(PROMPTS[2])
    inputs = []
    for name, value in (("input_ids", np.array([ids], np.int32)), ("input_lengths", np.array([[len(ids)]], np.int32)),
                        ("request_output_len", np.array([[12]], np.int32))):
        t = httpclient.InferInput(name, list(value.shape), "INT32")
        t.set_data_from_numpy(value)
        inputs.append(t)
    r = h.infer("tensorrt_llm", inputs)
    assert r.as_numpy("output_ids").reshape(-1).tolist() == offline(PROMPTS[2:3], 12)[0]


@pytest.mark.server
def test_streaming_on_a_non_decoupled_repository_is_one_clear_error(unary_server):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    g = grpcclient.InferenceServerClient(unary_server.grpc_url)
    with pytest.raises(InferenceServerException, match="streaming needs a decoupled model"):
        g.infer("ensemble", _ensemble_inputs(grpcclient, PROMPTS[0], 8, stream=True))
    # and the server still answers
    assert g.infer("ensemble", _ensemble_inputs(grpcclient, PROMPTS[0], 4)).as_numpy("output_ids").size > 0


@pytest.mark.server
def test_unary_infer_on_the_decoupled_repository_is_refused_by_triton(setup):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    with _server(setup[0][True]) as srv:
        g = grpcclient.InferenceServerClient(srv.grpc_url)
        with pytest.raises(InferenceServerException, match="decoupled"):
            g.infer("ensemble", _ensemble_inputs(grpcclient, PROMPTS[0], 4))


@pytest.mark.server
def test_overload_is_answered_at_once_with_server_busy(setup, unary_server):
    """24 requests at once against max_batch_size 2 + max_queue_size 2: each is served (== offline AR) or refused
    with the busy error, fast; none lost; the refusals are counted; the KV cache is empty afterwards."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    _, _, offline = setup
    n, max_tokens = 24, 60
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    want = dict(zip(PROMPTS, offline(PROMPTS, max_tokens)))
    results: list = [None] * n

    def one(i):
        g = grpcclient.InferenceServerClient(unary_server.grpc_url)
        t0 = time.monotonic()
        try:
            r = g.infer("ensemble", _ensemble_inputs(grpcclient, prompts[i], max_tokens), client_timeout=120)
            results[i] = ("ok", r.as_numpy("output_ids").reshape(-1).tolist(), time.monotonic() - t0)
        except InferenceServerException as e:
            results[i] = ("error", str(e), time.monotonic() - t0)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert all(r is not None for r in results), "a request got no answer"
    served = [i for i, r in enumerate(results) if r[0] == "ok"]
    busy = [i for i, r in enumerate(results) if r[0] == "error"]
    assert all("server busy" in results[i][1] and "max_queue_size=2" in results[i][1] for i in busy), \
        [results[i][1] for i in busy]
    assert all(results[i][1] == want[prompts[i]] for i in served)
    assert len(served) >= MAX_BATCH + QUEUE and busy, (len(served), len(busy))
    slowest_served = max(results[i][2] for i in served)
    assert max(results[i][2] for i in busy) < slowest_served  # refused at once, not after waiting its turn
    m = _idle(unary_server, timeout=10.0)
    assert sum_metric(m, "trt_redrafter_kv_blocks_used") == 0
    assert sum_metric(m, 'trt_redrafter_requests_total{model="tensorrt_llm",outcome="busy"}') == len(busy)
    assert sum_metric(scrape(unary_server.metrics_url), "trt_redrafter_waiting_requests") == 0
