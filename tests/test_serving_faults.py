"""Requests a real tritonserver must answer although they are wrong: every required input of every model left out.

Triton 2.51 checks a request's input count, not which inputs it carries; a request to the decoupled ensemble that
leaves out a required input while carrying enough others passed that check and then waited for ever for the missing
tensor (a stock client timed out after 60 s; with `enable_empty_final_response` it got one empty success; HTTP
generate_stream an empty 200). The repository now declares every input optional and each model refuses a request
without one of its required inputs in one sentence. Here: each required input of each model left out, with and
without a set of valid optional inputs, on both transaction policies (make-repo --decoupled true/false) and both
protocols (gRPC streaming or unary, HTTP generate_stream or infer): exactly one answer, an error naming the input,
within a bound, with a client-error status where the protocol has one (gRPC INVALID_ARGUMENT, HTTP 400); the server
still serves afterwards.
"""

from __future__ import annotations

import json
import queue
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from engine_utils import build_tiny_engines
from test_serving import _require_server, _server
from test_serving_modes import _tensors
from trt_redrafter.config import RuntimeConfig
from trt_redrafter.serving.repo import make_repo
from trt_redrafter.serving.text import TextCodec

BOUND_S = 20.0  # an answer comes within this, or the request counts as left hanging
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    _require_server()
    root = tmp_path_factory.mktemp("serving-faults")
    _, engines = build_tiny_engines(root, seed=17, num_beams=2, draft_len=2, tps=(1,), max_batch_size=2,
                                    max_seq_len=128)
    out = {}
    for decoupled in (True, False):
        out[decoupled] = root / f"repo-{decoupled}"
        make_repo(engines[1], out[decoupled], runtime=RuntimeConfig(compile="off", speculate="full"),
                  decoupled=decoupled)
    return out, TextCodec(engines[1] / "tokenizer")


@pytest.fixture(scope="module", params=[True, False], ids=["decoupled", "unary"])
def server(request, repos):
    srv = _server(repos[0][request.param]).start()
    yield request.param, srv
    report = srv.stop()
    assert report["returncode"] == 0 and report["killed"] == [], report


def _requests(codec: TextCodec) -> dict[str, tuple[dict, dict]]:
    """model -> (its required inputs, a set of valid optional ones), as numpy arrays with the batch dimension."""
    ids = codec.encode(PROMPT)
    text = {"text_input": np.array([[PROMPT]]).astype(object), "max_tokens": np.array([[4]], np.int32)}
    text_extras = {"temperature": np.array([[0.0]], np.float32), "end_id": np.array([[codec.end_id]], np.int32),
                   "return_perf_metrics": np.array([[True]]), "exclude_input_in_output": np.array([[True]])}
    return {
        "ensemble": (text, text_extras),
        "tensorrt_llm_bls": (text, text_extras),
        "preprocessing": ({"QUERY": np.array([[PROMPT]]).astype(object), "REQUEST_OUTPUT_LEN": np.array([[4]], np.int32)},
                          {"END_ID": np.array([[codec.end_id]], np.int32), "PAD_ID": np.array([[0]], np.int32)}),
        "postprocessing": ({"TOKENS_BATCH": np.array([[ids]], np.int32), "SEQUENCE_LENGTH": np.array([[len(ids)]],
                                                                                                    np.int32)},
                           {"PRECEDING_TOKENS": np.array([[ids[:1]]], np.int32).reshape(1, -1)}),
        "tensorrt_llm": ({"input_ids": np.array([ids], np.int32), "request_output_len": np.array([[4]], np.int32)},
                         {"input_lengths": np.array([[len(ids)]], np.int32), "runtime_top_k": np.array([[1]], np.int32),
                          "return_num_input_tokens": np.array([[True]])}),
    }


DECOUPLED_MODELS = {"ensemble", "tensorrt_llm_bls", "tensorrt_llm"}  # on the decoupled repository
CASES = [(model, missing) for model, req in (("ensemble", ("text_input", "max_tokens")),
                                             ("tensorrt_llm_bls", ("text_input", "max_tokens")),
                                             ("preprocessing", ("QUERY", "REQUEST_OUTPUT_LEN")),
                                             ("postprocessing", ("TOKENS_BATCH", "SEQUENCE_LENGTH")),
                                             ("tensorrt_llm", ("input_ids", "request_output_len")))
         for missing in req]
# what the answer names: the input itself, or what the ensemble/BLS call it at the model that checks it
NAMED = {"QUERY": "text_input", "REQUEST_OUTPUT_LEN": "max_tokens", "request_output_len": "request_output_len"}


def _grpc_stream(url: str, model: str, values: dict) -> list:
    """Every answer of one streaming request (enable_empty_final_response: a final response comes back whatever
    happens) until the final one, or until BOUND_S passes."""
    import tritonclient.grpc as grpcclient

    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: got.put(error or result))
    client.async_stream_infer(model, _tensors(grpcclient, values), enable_empty_final_response=True)
    answers, deadline = [], time.monotonic() + BOUND_S
    try:
        while time.monotonic() < deadline:
            try:
                a = got.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            answers.append(a)
            if isinstance(a, Exception) or a.get_response().parameters["triton_final_response"].bool_param:
                break
        time.sleep(0.2)  # anything more it would send
        while not got.empty():
            answers.append(got.get())
    finally:
        client.stop_stream(cancel_requests=True)
    return answers


def _http_generate_stream(url: str, model: str, values: dict) -> tuple[int, list[dict]]:
    body = {k: (v.reshape(-1)[0].decode() if v.dtype == object and isinstance(v.reshape(-1)[0], bytes)
                else v.reshape(-1)[0].item() if v.size == 1 and v.dtype != object
                else v.reshape(-1).tolist() if v.dtype != object else str(v.reshape(-1)[0]))
            for k, v in values.items()}
    req = urllib.request.Request(f"{url}/v2/models/{model}/generate_stream", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=BOUND_S) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    events = [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]
    if not events and text.strip():
        events = [json.loads(text)]
    return status, events


@pytest.mark.server
@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize("extras", [False, True], ids=["bare", "with-optional-inputs"])
@pytest.mark.parametrize("model,missing", CASES, ids=[f"{m}-{x}" for m, x in CASES])
def test_a_missing_required_input_gets_exactly_one_error(repos, server, model, missing, extras, protocol):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    decoupled, srv = server
    required, optional = _requests(repos[1])[model]
    values = {k: v for k, v in required.items() if k != missing}
    if extras:
        values.update(optional)
    named = NAMED.get(missing, missing)
    t0 = time.monotonic()
    if protocol == "grpc" and decoupled:  # the streaming API (the non-decoupled pre/postprocessing answer once there)
        answers = _grpc_stream(srv.grpc_url, model, values)
        assert len(answers) == 1 and isinstance(answers[0], InferenceServerException), answers
        error = str(answers[0])
    elif protocol == "grpc":
        with pytest.raises(InferenceServerException) as e:
            grpcclient.InferenceServerClient(srv.grpc_url).infer(model, _tensors(grpcclient, values),
                                                                 client_timeout=BOUND_S)
        error = str(e.value)
        assert e.value.status() == "StatusCode.INVALID_ARGUMENT", error  # the client's mistake
    elif decoupled and model in DECOUPLED_MODELS:  # HTTP's streaming: generate_stream (server-sent events)
        status, events = _http_generate_stream(srv.http_url, model, values)
        errors = [e for e in events if "error" in e]
        assert len(events) == 1 and len(errors) == 1, (status, events)
        error = errors[0]["error"]
    else:
        client = httpclient.InferenceServerClient(srv.http_url.removeprefix("http://"), network_timeout=BOUND_S)
        try:
            with pytest.raises(InferenceServerException) as e:
                client.infer(model, _tensors(httpclient, values))
        finally:
            client.close()  # an open keep-alive connection holds tritonserver's exit for its whole timeout
        error = str(e.value)
        assert e.value.status() == "400", error
    assert time.monotonic() - t0 < BOUND_S
    assert named in error, error
    # and the server still serves
    text, _ = _requests(repos[1])["ensemble"]
    if decoupled:
        answers = _grpc_stream(srv.grpc_url, "ensemble", text)
        assert not isinstance(answers[-1], Exception) and answers[0].as_numpy("text_output") is not None
    else:
        r = grpcclient.InferenceServerClient(srv.grpc_url).infer("ensemble", _tensors(grpcclient, text))
        assert r.as_numpy("output_ids").size > 0
