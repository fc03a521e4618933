"""The engine model's transaction policy and admission limit, through a real tritonserver (CPU):

* `make-repo --decoupled false`: unary gRPC `ModelInfer` and HTTP `infer` on the ensemble and on the engine model
  answer once with the offline AR output (what tensorrtllm_backend's `inflight_batcher_llm_client.py` without
  `--streaming`, and `end_to_end_test.py` / `benchmark_core_model.py` over HTTP, do); a streaming request gets one
  clear error; the stock decoupled repository refuses unary calls as before (Triton's own error).
* `make-repo --max-queue-size N`: at many times what the engine can run, every request is either served (output ==
  offline AR) or refused at once with the busy error; none is lost or hangs, and the KV cache is empty afterwards.
"""

from __future__ import annotations

import re
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
from trt_redrafter.serving.text import REPLACEMENT, TextCodec

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
        make_repo(engines[1], repos[decoupled], runtime=RuntimeConfig(compile="off", speculate="full"), decoupled=decoupled,
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


@pytest.fixture(scope="module")
def stream_server(setup):
    srv = _server(setup[0][True]).start()
    yield srv
    report = srv.stop()
    assert report["returncode"] == 0 and report["killed"] == [], report


@pytest.mark.server
def test_unary_infer_on_the_decoupled_repository_is_refused_by_triton(stream_server):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    g = grpcclient.InferenceServerClient(stream_server.grpc_url)
    with pytest.raises(InferenceServerException, match="decoupled"):
        g.infer("ensemble", _ensemble_inputs(grpcclient, PROMPTS[0], 4))


def _tensors(mod, values: dict) -> list:
    dtypes = {np.dtype(np.int32): "INT32", np.dtype(np.float32): "FP32", np.dtype(bool): "BOOL",
              np.dtype(np.uint64): "UINT64", np.dtype(object): "BYTES"}
    out = []
    for name, value in values.items():
        t = mod.InferInput(name, list(value.shape), dtypes[value.dtype])
        t.set_data_from_numpy(value)
        out.append(t)
    return out


def _stream_all(url: str, model: str, inputs: list, outputs=None, request_id: str = "",
                empty_final: bool = False) -> list:
    """What the stock clients do on the streaming API: start a stream, send, stop_stream() (waits for the server to
    close it), then drain the results (an InferResult or an InferenceServerException each). empty_final: ask for
    Triton's empty final response (`enable_empty_final_response`, as genai-perf and the OpenAI frontends do)."""
    import queue

    import tritonclient.grpc as grpcclient

    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: got.put(error or result))
    client.async_stream_infer(model, inputs, outputs=outputs, request_id=request_id,
                              enable_empty_final_response=empty_final)
    client.stop_stream()
    return [got.get() for _ in range(got.qsize())]


@pytest.mark.server
@pytest.mark.parametrize("streaming", [False, True])
def test_end_to_end_grpc_client(setup, stream_server, streaming):
    """tensorrtllm_backend inflight_batcher_llm/client/end_to_end_grpc_client.py --temperature 0 [--streaming]
    [--return-perf-metrics] (@ c1e1963): its tensors (exclude_input_in_output always sent, false), its requested
    outputs, and its reading `text_output[0].decode()`, appended per response when streaming. Not streaming and not
    excluding the input, the text holds the prompt first (its --check-outputs expects prompt + output)."""
    import tritonclient.grpc as grpcclient

    _, codec, offline = setup
    prompt, n = PROMPTS[1], 14
    want = offline([prompt], n)[0]
    values = {"text_input": np.array([[prompt]]).astype(object), "max_tokens": np.array([[n]], np.int32),
              "stream": np.array([[streaming]], bool), "beam_width": np.array([[1]], np.int32),
              "temperature": np.array([[0.0]], np.float32), "return_perf_metrics": np.array([[True]], bool),
              "exclude_input_in_output": np.array([[False]], bool)}
    perf = ["kv_cache_alloc_new_blocks", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks", "arrival_time_ns",
            "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns", "acceptance_rate",
            "total_accepted_draft_tokens", "total_draft_tokens"]
    outputs = [grpcclient.InferRequestedOutput(name) for name in ["text_output", *perf]]
    results = _stream_all(stream_server.grpc_url, "ensemble", _tensors(grpcclient, values), outputs)
    assert results and not any(isinstance(r, Exception) for r in results), results
    text = ""
    for r in results:
        output = r.as_numpy("text_output")
        text += output[0].decode("utf-8")  # the client's line; a [1, 1] array has no .decode
        metrics = {name: r.as_numpy(name)[0][0] for name in perf}  # the client prints each as [0][0]
    prompt_ids = codec.encode(prompt)
    assert text == (codec.decode(want) if streaming else codec.decode(prompt_ids + want)).rstrip(REPLACEMENT)
    assert len(results) > 1 if streaming else len(results) == 1
    t = [metrics[k] for k in ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns",
                              "last_token_time_ns")]
    assert 0 < t[0] <= t[1] <= t[2] <= t[3] and abs(t[0] - time.time_ns()) < 300e9
    assert metrics["kv_cache_alloc_total_blocks"] >= 1 and metrics["kv_cache_reused_blocks"] == 0
    assert metrics["total_draft_tokens"] > 0


@pytest.mark.server
def test_inflight_batcher_llm_client_streaming_and_stop(setup, stream_server):
    """inflight_batcher_llm/client/inflight_batcher_llm_client.py --streaming [--stop-after-ms] (@ c1e1963): token
    ids straight to tensorrt_llm with its always-sent tensors (temperature 1.0 with top_k 1, top_p 0.0: greedy),
    output_ids[0][0] appended while sequence_length[0][0] > 0; then a stop request on the same stream (same id,
    stop=true, empty input_ids), answered by a response without output_ids."""
    import tritonclient.grpc as grpcclient

    _, codec, offline = setup
    ids = codec.encode(PROMPTS[3])
    values = {"input_ids": np.array([ids], np.int32), "input_lengths": np.array([[len(ids)]], np.int32),
              "request_output_len": np.array([[16]], np.int32), "beam_width": np.array([[1]], np.int32),
              "temperature": np.array([[1.0]], np.float32), "streaming": np.array([[True]], bool),
              "end_id": np.array([[codec.end_id]], np.int32), "pad_id": np.array([[codec.pad_id]], np.int32),
              "runtime_top_k": np.array([[1]], np.int32), "runtime_top_p": np.array([[0.0]], np.float32)}
    results = _stream_all(stream_server.grpc_url, "tensorrt_llm", _tensors(grpcclient, values), request_id="7")
    assert not any(isinstance(r, Exception) for r in results), results
    tokens = []
    for r in results:
        if r.as_numpy("sequence_length")[0][0] > 0:
            tokens += r.as_numpy("output_ids")[0][0].tolist()
    assert tokens == offline([PROMPTS[3]], 16)[0]
    stop = {"input_ids": np.empty([1, 1], np.int32), "input_lengths": np.array([[0]], np.int32),
            "request_output_len": np.array([[0]], np.int32), "stop": np.array([[True]], bool)}
    answers = _stream_all(stream_server.grpc_url, "tensorrt_llm", _tensors(grpcclient, stop), request_id="7")
    assert len(answers) <= 1 and not any(isinstance(r, Exception) for r in answers)


@pytest.mark.server
def test_end_to_end_test_over_http(setup, unary_server):
    """tools/inflight_batcher_llm/end_to_end_test.py (@ c1e1963, HTTP, unary, a non-decoupled repository): each model
    of the pipeline called by hand (preprocessing with REQUEST_OUTPUT_LEN and empty word lists, tensorrt_llm with
    preprocessing's outputs including DECODER_INPUT_ID, postprocessing), then the ensemble; the two texts agree."""
    import tritonclient.http as httpclient

    _, codec, offline = setup
    h = httpclient.InferenceServerClient(unary_server.http_url.removeprefix("http://"))
    prompt, n = PROMPTS[0], 10
    pre = h.infer("preprocessing", _tensors(httpclient, {
        "QUERY": np.array([[prompt]]).astype(object), "BAD_WORDS_DICT": np.array([[""]]).astype(object),
        "STOP_WORDS_DICT": np.array([[""]]).astype(object), "REQUEST_OUTPUT_LEN": np.array([[n]], np.int32)}))
    out = {k: pre.as_numpy(k) for k in ("INPUT_ID", "REQUEST_INPUT_LEN", "REQUEST_OUTPUT_LEN", "DECODER_INPUT_ID",
                                        "OUT_END_ID", "OUT_PAD_ID")}
    assert all(v is not None for v in out.values()), out
    assert out["REQUEST_OUTPUT_LEN"].tolist() == [[n]]
    eng = h.infer("tensorrt_llm", _tensors(httpclient, {
        "input_ids": out["INPUT_ID"], "decoder_input_ids": out["DECODER_INPUT_ID"],
        "input_lengths": out["REQUEST_INPUT_LEN"], "request_output_len": out["REQUEST_OUTPUT_LEN"],
        "end_id": out["OUT_END_ID"], "pad_id": out["OUT_PAD_ID"]}))
    output_ids, seq_len = eng.as_numpy("output_ids"), eng.as_numpy("sequence_length")
    assert output_ids[0][0][:seq_len[0][0]].tolist() == offline([prompt], n)[0]
    post = h.infer("postprocessing", _tensors(httpclient, {"TOKENS_BATCH": output_ids, "SEQUENCE_LENGTH": seq_len}))
    ens = h.infer("ensemble", _tensors(httpclient, {
        "text_input": np.array([[prompt]]).astype(object), "max_tokens": np.array([[n]], np.int32),
        "bad_words": np.array([[""]]).astype(object), "stop_words": np.array([[""]]).astype(object)}))
    assert post.as_numpy("OUTPUT").tolist() == ens.as_numpy("text_output").tolist() == \
        [codec.decode(offline([prompt], n)[0]).rstrip(REPLACEMENT).encode()]


@pytest.mark.server
def test_benchmark_core_model_over_http(setup, unary_server):
    """tools/inflight_batcher_llm/benchmark_core_model.py --exclude-input-in-output (@ c1e1963, HTTP): input_ids,
    input_lengths, request_output_len, pad_id, end_id only, no outputs requested; it counts the tokens of a response
    as the third dim of the first output tensor (output_ids [1, beam, len])."""
    import tritonclient.http as httpclient

    _, codec, offline = setup
    h = httpclient.InferenceServerClient(unary_server.http_url.removeprefix("http://"))
    ids = codec.encode(PROMPTS[2])
    r = h.infer("tensorrt_llm", _tensors(httpclient, {
        "input_ids": np.array([ids], np.int32), "input_lengths": np.array([[len(ids)]], np.int32),
        "request_output_len": np.array([[12]], np.int32), "pad_id": np.array([[0]], np.int32),
        "end_id": np.array([[1]], np.int32)}))
    first = r.get_response()["outputs"][0]
    assert first["name"] == "output_ids" and first["shape"][2] == 12


MALFORMED = [  # (model, inputs beside a valid request's, error text)
    ("ensemble", {"max_tokens": np.array([[0]], np.int32)}, "max_tokens must be a positive integer"),
    ("ensemble", {"max_tokens": np.array([[10 ** 6]], np.int32)}, "exceeds the engine's max_seq_len"),
    ("ensemble", {"text_input": np.array([[""]]).astype(object)}, "text_input is empty"),
    ("ensemble", {"text_input": np.array([[b"caf\xe9 \xff"]]).astype(object)}, "input 'text_input' is not valid UTF-8"),
    ("ensemble", {"beam_width": np.array([[2]], np.int32)}, "beam_width=2 is not supported"),
    ("ensemble", {"top_k": np.array([[-1]], np.int32)}, "bad sampling parameters"),
    ("ensemble", {"temperature": np.array([[-0.5]], np.float32)}, "bad sampling parameters"),
    ("ensemble", {"temperature": np.array([[np.nan]], np.float32)}, "input 'temperature' must be a finite number"),
    ("ensemble", {"top_p": np.array([[np.inf]], np.float32)}, "input 'runtime_top_p' must be a finite number"),
    ("ensemble", {"length_penalty": np.array([[-np.inf]], np.float32)}, "must be a finite number"),
    ("ensemble", {"seed": np.array([[2 ** 63]], np.uint64)}, "seed"),
    ("ensemble", {"repetition_penalty": np.array([[1.2]], np.float32)}, "repetition_penalty=1.2"),
    ("ensemble", {"min_tokens": np.array([[5]], np.int32)}, "min_tokens=5"),
    ("ensemble", {"num_return_sequences": np.array([[2]], np.int32)}, "num_return_sequences=2"),
    ("tensorrt_llm", {"top_logprobs": np.array([[21]], np.int32)}, "top_logprobs=21 is above this engine's limit"),
    ("ensemble", {"bad_words": np.array([["fox"]]).astype(object)}, "bad_words cannot be honoured"),
    ("ensemble", {"embedding_bias_words": np.array([["fox"]]).astype(object),
                  "embedding_bias_weights": np.array([[1.0]], np.float32)}, "logits bias"),
    ("ensemble", {"decoder_text_input": np.array([["x"]]).astype(object)}, "decoder-only"),
    ("ensemble", {"lora_task_id": np.array([[3]], np.uint64)}, "LoRA"),
    ("ensemble", {"guided_decoding_guide_type": np.array([["xml"]]).astype(object)},
     "guided decoding type must be one of json, json_schema"),
    ("ensemble", {"guided_decoding_guide_type": np.array([["regex"]]).astype(object),
                  "guided_decoding_guide": np.array([["[0-"]]).astype(object)}, "invalid regex guide"),
    ("ensemble", {"decoding_mode": np.array([["medusa"]]).astype(object)}, "decoding_mode must be one of"),
    ("tensorrt_llm", {"input_lengths": np.array([[99]], np.int32)}, "input_lengths=99"),
    ("tensorrt_llm", {"input_ids": np.array([[5, 10 ** 7]], np.int32), "input_lengths": np.array([[2]], np.int32)},
     "10000000"),
    ("tensorrt_llm", {"stop_words_list": np.array([[[5, 6, 7]]], np.int32)}, "unexpected shape for input 'stop_words_list'"),  # Triton's check
    ("tensorrt_llm", {"request_output_len": np.array([[4, 5]], np.int32)}, "unexpected shape for input 'request_output_len'"),
]


@pytest.mark.server
@pytest.mark.parametrize("decoupled,empty_final", [(True, False), (True, True), (False, False)],
                         ids=["streaming", "streaming-empty-final", "unary"])
@pytest.mark.parametrize("extras", [False, True], ids=["bare", "with-optional-inputs"])
@pytest.mark.parametrize("case", range(len(MALFORMED)))
def test_malformed_requests_get_exactly_one_error(setup, stream_server, unary_server, case, extras, decoupled,
                                                  empty_final):
    """Each malformed request, alone and beside a set of valid optional inputs, on the streaming API (decoupled
    repository; with and without `enable_empty_final_response`) and as a unary call: exactly one response, an error
    naming what is wrong; the server stays well."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    _, codec, _ = setup
    model, bad, message = MALFORMED[case]
    if model == "ensemble":
        values = {"text_input": np.array([[PROMPTS[0]]]).astype(object), "max_tokens": np.array([[8]], np.int32)}
        if extras:
            values.update({"stream": np.array([[decoupled]], bool), "temperature": np.array([[0.0]], np.float32),
                           "end_id": np.array([[codec.end_id]], np.int32), "return_perf_metrics": np.array([[True]]),
                           "exclude_input_in_output": np.array([[True]]), "stop_words": np.array([["zz"]]).astype(object)})
    else:
        ids = codec.encode(PROMPTS[0])
        values = {"input_ids": np.array([ids], np.int32), "input_lengths": np.array([[len(ids)]], np.int32),
                  "request_output_len": np.array([[8]], np.int32)}
        if extras:
            values.update({"streaming": np.array([[decoupled]], bool), "runtime_top_k": np.array([[1]], np.int32),
                           "return_num_input_tokens": np.array([[True]])})
    values.update(bad)
    server = stream_server if decoupled else unary_server
    if decoupled:
        results = _stream_all(server.grpc_url, model, _tensors(grpcclient, values), empty_final=empty_final)
        assert len(results) == 1 and isinstance(results[0], InferenceServerException), results
        error = str(results[0])
    else:
        with pytest.raises(InferenceServerException) as e:
            grpcclient.InferenceServerClient(server.grpc_url).infer(model, _tensors(grpcclient, values),
                                                                   client_timeout=60)
        error = str(e.value)
        assert e.value.status() == "StatusCode.INVALID_ARGUMENT", error  # a client error, not an internal one
    assert message in error, error
    ok = _stream_all(server.grpc_url, "ensemble", _tensors(grpcclient, {
        "text_input": np.array([[PROMPTS[0]]]).astype(object), "max_tokens": np.array([[2]], np.int32)})) \
        if decoupled else [grpcclient.InferenceServerClient(server.grpc_url).infer("ensemble", _ensemble_inputs(
            grpcclient, PROMPTS[0], 2))]
    assert not isinstance(ok[-1], Exception) and ok[-1].as_numpy("output_ids").size > 0


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
    # the engine's scheduler refuses with "server busy"; Triton's own queue in front of the model has the same limit
    # (default_queue_policy) and refuses a burst that outruns execute() with "Exceeds maximum queue size", as it
    # does in front of TensorRT-LLM's backend (whose queue test accepts either)
    ours = [i for i in busy if "server busy" in results[i][1] and "max_queue_size=2" in results[i][1]]
    assert all(i in ours or "Exceeds maximum queue size" in results[i][1] for i in busy), \
        [results[i][1] for i in busy]
    assert all(results[i][1] == want[prompts[i]] for i in served)
    # how many get through depends on how the burst meets execute(): Triton's queue alone guarantees the first
    # request taken and QUEUE more (a loaded machine gives exactly that); the engine's own refusal is tested
    # deterministically in test_scheduler.py
    assert len(served) >= 1 + QUEUE and busy, (len(served), len(busy))
    slowest_served = max(results[i][2] for i in served)
    assert max(results[i][2] for i in busy) < slowest_served  # refused at once, not after waiting its turn
    m = _idle(unary_server, timeout=10.0)
    assert sum_metric(m, "trt_redrafter_kv_blocks_used") == 0
    assert sum_metric(m, 'trt_redrafter_requests_total{model="tensorrt_llm",outcome="busy"}') == len(ours)
    assert sum_metric(scrape(unary_server.metrics_url), "trt_redrafter_waiting_requests") == 0


@pytest.mark.server
def test_stock_metric_families(setup, unary_server):
    """The families dashboards built on TensorRT-LLM's backend read (names, labels model/version + category), with
    values that agree with the engine's own gauges, and the per-request token-length histograms."""
    import urllib.request

    from trt_redrafter.serving.metrics import metric_key, parse_prometheus

    import tritonclient.grpc as grpcclient

    g = grpcclient.InferenceServerClient(unary_server.grpc_url)
    before = parse_prometheus(urllib.request.urlopen(unary_server.metrics_url).read().decode(), prefix="nv_llm")
    g.infer("ensemble", _ensemble_inputs(grpcclient, PROMPTS[1], 9))
    _idle(unary_server)
    time.sleep(0.3)  # one more gauge refresh (serving/engine_model.py METRICS_PERIOD_S)
    text = urllib.request.urlopen(unary_server.metrics_url).read().decode()
    trt = parse_prometheus(text, prefix="nv_trt_llm_")
    ours = parse_prometheus(text)
    lab = {"model": "tensorrt_llm", "version": "1"}

    def stock(family, label, value):
        return trt[metric_key(family, **lab, **{label: value})]

    assert stock("nv_trt_llm_request_metrics", "request_type", "max") == MAX_BATCH
    assert stock("nv_trt_llm_request_metrics", "request_type", "active") == 0
    total = sum_metric(ours, "trt_redrafter_kv_blocks_total")
    assert stock("nv_trt_llm_kv_cache_block_metrics", "kv_cache_block_type", "max") == total > 0
    assert stock("nv_trt_llm_kv_cache_block_metrics", "kv_cache_block_type", "free") == total
    assert stock("nv_trt_llm_kv_cache_block_metrics", "kv_cache_block_type", "tokens_per") > 0
    assert stock("nv_trt_llm_general_metrics", "general_type", "iteration_counter") > 0
    assert abs(stock("nv_trt_llm_general_metrics", "general_type", "timestamp") / 1e6 - time.time()) < 60
    assert "inflight_batcher_specific_metric" in text
    after = parse_prometheus(text, prefix="nv_llm")
    key = metric_key("nv_llm_input_token_len_count", **lab, response_metric_type="total_input_tokens")
    assert after[key] == before.get(key, 0) + 1
    key = metric_key("nv_llm_output_token_len_sum", **lab, response_metric_type="total_output_tokens")
    assert after[key] - before.get(key, 0) == len(setup[2]([PROMPTS[1]], 9)[0])  # stops at EOS like offline


@pytest.mark.server
@pytest.mark.parametrize("streaming", [False, True])
def test_end_to_end_grpc_client_on_the_bls_model(setup, stream_server, streaming):
    """end_to_end_grpc_client.py --model-name tensorrt_llm_bls --temperature 0 [--streaming] (@ c1e1963): the same
    tensors as against the ensemble; the text equals the ensemble's and offline AR's."""
    import tritonclient.grpc as grpcclient

    _, codec, offline = setup
    prompt, n = PROMPTS[0], 12
    want = offline([prompt], n)[0]
    values = {"text_input": np.array([[prompt]]).astype(object), "max_tokens": np.array([[n]], np.int32),
              "stream": np.array([[streaming]], bool), "beam_width": np.array([[1]], np.int32),
              "temperature": np.array([[0.0]], np.float32), "exclude_input_in_output": np.array([[True]], bool)}
    results = _stream_all(stream_server.grpc_url, "tensorrt_llm_bls", _tensors(grpcclient, values),
                          [grpcclient.InferRequestedOutput("text_output"),
                           grpcclient.InferRequestedOutput("output_ids")])
    assert results and not any(isinstance(r, Exception) for r in results), results
    text = "".join(r.as_numpy("text_output")[0].decode("utf-8") for r in results)
    ids = [i for r in results for i in r.as_numpy("output_ids").reshape(-1).tolist()]
    assert ids == want and text == codec.decode(want).rstrip(REPLACEMENT)
    assert len(results) > 1 if streaming else len(results) == 1
    bad = _stream_all(stream_server.grpc_url, "tensorrt_llm_bls", _tensors(grpcclient, {
        **values, "max_tokens": np.array([[0]], np.int32)}))
    assert len(bad) == 1 and "max_tokens must be a positive integer" in str(bad[0])


@pytest.mark.server
def test_end_to_end_test_bls_over_http(setup, unary_server):
    """end_to_end_test.py --test-bls (@ c1e1963, HTTP, unary): the ensemble's inputs sent to tensorrt_llm_bls; its
    text_output equals the ensemble's."""
    import tritonclient.http as httpclient

    h = httpclient.InferenceServerClient(unary_server.http_url.removeprefix("http://"))
    values = {"text_input": np.array([[PROMPTS[2]]]).astype(object), "max_tokens": np.array([[10]], np.int32),
              "bad_words": np.array([[""]]).astype(object), "stop_words": np.array([[""]]).astype(object)}
    bls = h.infer("tensorrt_llm_bls", _tensors(httpclient, values)).as_numpy("text_output")
    ens = h.infer("ensemble", _tensors(httpclient, values)).as_numpy("text_output")
    assert bls.tolist() == ens.tolist() and len(bls) == 1


def _stop_inputs(mod) -> list:
    """inflight_batcher_llm_client.py's prepare_stop_signals(): empty input_ids, lengths 0, stop=true."""
    return _tensors(mod, {"input_ids": np.zeros([1, 1], np.int32), "input_lengths": np.zeros([1, 1], np.int32),
                          "request_output_len": np.zeros([1, 1], np.int32), "stop": np.array([[True]], bool)})


@pytest.mark.server
@pytest.mark.parametrize("decoupled", [False, True], ids=["unary", "decoupled-not-streamed"])
def test_early_stopping_returns_the_tokens_so_far(setup, stream_server, unary_server, decoupled):
    """tensorrtllm_backend README's "Early stopping" example, inflight_batcher_llm_client.py --stop-after-ms 200
    --request-output-len ... --request-id 1 (@ c1e1963): the request, then after 200 ms (shorter where the request was
    already done) a stop request with the same id. Unary (`--decoupled false`: async_infer twice) and not streamed on a
    decoupled repository (the streaming API, streaming=false): the stopped request ends with a final response holding
    the tokens generated so far (a prefix of the offline output, shorter than asked), the stop request with one empty
    response; no error. A client's cancellation stays a cancellation (test_serving)."""
    import queue

    import tritonclient.grpc as grpcclient

    _, codec, offline = setup
    n = 140
    ids = codec.encode(PROMPTS[1])
    values = {"input_ids": np.array([ids], np.int32), "input_lengths": np.array([[len(ids)]], np.int32),
              "request_output_len": np.array([[n]], np.int32), "beam_width": np.array([[1]], np.int32),
              "temperature": np.array([[0.0]], np.float32), "streaming": np.array([[False]], bool),
              "end_id": np.array([[-1]], np.int32)}
    srv = stream_server if decoupled else unary_server
    client = grpcclient.InferenceServerClient(srv.grpc_url)

    def stopped_after(delay: float, rid: str) -> list[int]:
        got: queue.Queue = queue.Queue()
        if decoupled:
            client.start_stream(callback=lambda result, error: got.put(error or result))
            client.async_stream_infer("tensorrt_llm", _tensors(grpcclient, values), request_id=rid)
            time.sleep(delay)
            client.async_stream_infer("tensorrt_llm", _stop_inputs(grpcclient), request_id=rid)
            client.stop_stream()
            answers = [got.get() for _ in range(got.qsize())]
        else:
            client.async_infer("tensorrt_llm", _tensors(grpcclient, values), request_id=rid,
                               callback=lambda result, error: got.put(error or result))
            time.sleep(delay)
            client.async_infer("tensorrt_llm", _stop_inputs(grpcclient), request_id=rid,
                               callback=lambda result, error: got.put(error or result))
            answers = [got.get(timeout=60) for _ in range(2)]
        assert not any(isinstance(a, Exception) for a in answers), answers
        outputs = [a.as_numpy("output_ids") for a in answers if a.as_numpy("output_ids") is not None]
        assert len(outputs) == 1, answers  # the stop request's own answer carries no output_ids
        return outputs[0].reshape(-1).tolist()

    # The README's 200 ms, then shorter waits: a fast machine can finish all n tokens before a late stop arrives (a
    # stop that comes after its request ended has nothing to end). A stop that never works gives n tokens each time.
    for i, delay in enumerate((0.2, 0.05, 0.02, 0.005)):
        tokens = stopped_after(delay, rid=f"1{i}")
        if 0 < len(tokens) < n:
            break
    # what the same request gives when nobody stops it (end_id -1: all n tokens; offline() stops at eos)
    if decoupled:
        whole = _stream_all(srv.grpc_url, "tensorrt_llm", _tensors(grpcclient, values), request_id="2")[-1]
    else:
        whole = client.infer("tensorrt_llm", _tensors(grpcclient, values), request_id="2")
    want = whole.as_numpy("output_ids").reshape(-1).tolist()
    first = offline([PROMPTS[1]], 8)[0]  # up to eos, where offline() stops
    assert len(want) == n and want[:len(first)] == first
    assert 0 < len(tokens) < n and tokens == want[:len(tokens)], (len(tokens), tokens[:8])
    m = _idle(srv, timeout=5.0)
    assert sum_metric(m, "trt_redrafter_kv_blocks_used") == 0


def _by_batch_index(results: list, streaming: bool) -> dict[int, str]:
    """end_to_end_grpc_client.py --batch-inputs' reading (@ c1e1963): each response's text goes to its row by the
    `batch_index` output, appended when streaming."""
    texts: dict[int, str] = {}
    for r in results:
        if r.as_numpy("text_output") is None:  # a bare final flag
            continue
        i = int(r.as_numpy("batch_index")[0][0])
        piece = r.as_numpy("text_output")[0].decode("utf-8")
        texts[i] = texts.get(i, "") + piece if streaming else piece
    return texts


@pytest.mark.server
@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
@pytest.mark.parametrize("streaming", [False, True])
def test_batch_inputs_are_answered_row_by_row(setup, stream_server, model, streaming):
    """end_to_end_grpc_client.py --batch-inputs (@ c1e1963): two prompts in one request, every input [2, 1], the
    streaming API whatever --streaming says. As TensorRT-LLM's backend does, the engine runs one request per row,
    in flight with the others, and answers each with its `batch_index`; each row's text == offline AR of that
    prompt alone, and the request ends with exactly one final flag."""
    import tritonclient.grpc as grpcclient

    _, codec, offline = setup
    prompts, n = [PROMPTS[0], PROMPTS[3] + " there was a"], 12
    want = offline(prompts, n)
    b = len(prompts)
    values = {"text_input": np.array([[p] for p in prompts]).astype(object),
              "max_tokens": np.full((b, 1), n, np.int32), "stream": np.full((b, 1), streaming, bool),
              "beam_width": np.ones((b, 1), np.int32), "temperature": np.zeros((b, 1), np.float32)}
    outputs = [grpcclient.InferRequestedOutput(name) for name in ("text_output", "batch_index")]
    results = _stream_all(stream_server.grpc_url, model, _tensors(grpcclient, values), outputs, empty_final=True)
    assert not any(isinstance(r, Exception) for r in results), results
    finals = [r.get_response().parameters["triton_final_response"].bool_param for r in results]
    assert finals.count(True) == 1 and finals[-1], finals
    texts = _by_batch_index(results, streaming)
    assert texts == {i: codec.decode(ids).rstrip(REPLACEMENT) for i, ids in enumerate(want)}
    assert len(results) >= (b * 2 if streaming else b)  # every row answered on its own
    assert sum_metric(_idle(stream_server, timeout=5.0), "trt_redrafter_kv_blocks_used") == 0


@pytest.mark.server
def test_a_batch_to_the_engine_model_splits_rows_with_their_own_parameters(setup, stream_server, unary_server):
    """benchmark_core_model.py-style token ids, two rows padded to the longest: each row is cut to its
    input_lengths and decoded with its own request_output_len; the rows run in flight (max_batch_size 2) and both
    are answered before the final flag. A non-decoupled repository refuses a batch in one sentence, as TensorRT-LLM
    does (one response per request cannot carry rows that finish apart)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    _, codec, offline = setup
    prompts, lens = [PROMPTS[1], PROMPTS[2] + " return"], [9, 5]
    ids = [codec.encode(p) for p in prompts]
    width = max(map(len, ids))
    padded = np.full((2, width), codec.pad_id, np.int32)
    for i, x in enumerate(ids):
        padded[i, :len(x)] = x
    values = {"input_ids": padded, "input_lengths": np.array([[len(x)] for x in ids], np.int32),
              "request_output_len": np.array([[m] for m in lens], np.int32),
              "end_id": np.full((2, 1), -1, np.int32)}
    results = _stream_all(stream_server.grpc_url, "tensorrt_llm", _tensors(grpcclient, values))
    assert not any(isinstance(r, Exception) for r in results), results
    rows = {int(r.as_numpy("batch_index")[0][0]): r.as_numpy("output_ids").reshape(-1).tolist() for r in results
            if r.as_numpy("output_ids") is not None}
    for i, (prompt, m) in enumerate(zip(prompts, lens)):
        first = offline([prompt], m)[0]  # offline stops at eos; end_id -1 runs all m tokens
        assert len(rows[i]) == m and rows[i][:len(first)] == first
    m = _idle(stream_server, timeout=5.0)
    assert sum_metric(m, "trt_redrafter_kv_blocks_used") == 0
    # a row whose input_lengths overflows its padded row is named
    bad = dict(values, input_lengths=np.array([[len(ids[0])], [width + 3]], np.int32))
    [err] = _stream_all(stream_server.grpc_url, "tensorrt_llm", _tensors(grpcclient, bad))
    assert isinstance(err, InferenceServerException) and "prompt 1 of the batch" in str(err), err
    g = grpcclient.InferenceServerClient(unary_server.grpc_url)
    with pytest.raises(InferenceServerException, match="needs a decoupled model") as e:
        g.infer("tensorrt_llm", _tensors(grpcclient, values))
    assert "INVALID_ARG" in str(e.value.status())


@pytest.mark.server
def test_guided_decoding_inputs_constrain_the_engine_model(setup, stream_server):
    """TensorRT-LLM's guided decoding inputs on the engine model, from the stock gRPC client: the output matches the
    regex (the tiny model alone does not write it) and equals the offline engine's constrained output; a regex that
    does not parse gets one INVALID_ARG naming it."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    from trt_redrafter.config import Guide

    _, codec, _ = setup
    regex = r"[0-9]{3}-[a-z]{2,4}"
    ids = codec.encode(PROMPTS[0])
    values = {"input_ids": np.array([ids], np.int32), "input_lengths": np.array([[len(ids)]], np.int32),
              "request_output_len": np.array([[24]], np.int32), "end_id": np.array([[codec.end_id]], np.int32),
              "guided_decoding_guide_type": np.array([[b"regex"]], dtype=object),
              "guided_decoding_guide": np.array([[regex.encode()]], dtype=object)}
    results = _stream_all(stream_server.grpc_url, "tensorrt_llm", _tensors(grpcclient, values))
    assert not any(isinstance(r, Exception) for r in results), results
    out = [t for r in results if r.as_numpy("output_ids") is not None for t in r.as_numpy("output_ids").reshape(-1)]
    assert re.fullmatch(regex, codec.decode([t for t in out if t != codec.end_id]))
    want = generate(load_engine(setup[0][True].parent / "engine-tp1"), [ids], SamplingConfig(max_tokens=24),
                    stop_ids=(codec.end_id,), guide=Guide.parse("regex", regex))[0].output_ids
    assert [int(t) for t in out] == want
    bad = dict(values, guided_decoding_guide=np.array([[b"[0-"]], dtype=object))
    [err] = _stream_all(stream_server.grpc_url, "tensorrt_llm", _tensors(grpcclient, bad))
    assert isinstance(err, InferenceServerException) and "invalid regex guide" in str(err), err
