"""The stock TensorRT-LLM Triton contract without a server: the repository make-repo writes declares every input and
output of tensorrtllm_backend's ensemble, preprocessing, postprocessing and tensorrt_llm models (serving/contract.py)
with the same type and dims, optional wherever the stock one is; and the engine model's request parsing honours each
stock input or refuses it in one sentence naming it (never ignores a request that asks for something).

The same requests through a real tritonserver: tests/test_serving_modes.py.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from engine_utils import build_tiny_engines
from trt_redrafter.errors import UserError
from trt_redrafter.serving import contract
from trt_redrafter.serving.engine_model import _NEUTRAL, _UNSUPPORTED, parse_inputs, split_rows
from trt_redrafter.serving.repo import make_repo

_ENTRY = re.compile(r'\{\s*name:\s*"([^"]+)"\s+data_type:\s*(\w+)\s+dims:\s*\[([^\]]*)\]([^}]*)\}')


def declared(config: str, section: str) -> dict[str, contract.Tensor]:
    """{name: Tensor} of a config.pbtxt's top-level `input [...]` or `output [...]` block."""
    block = re.search(rf"^{section} \[\n(.*?)^\]", config, flags=re.S | re.M).group(1)
    return {m.group(1): contract.Tensor(m.group(1), m.group(2), tuple(int(d) for d in m.group(3).split(",")),
                                        "optional: true" in m.group(4))
            for m in _ENTRY.finditer(block)}


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("contract")
    _, engines = build_tiny_engines(root, seed=3, num_beams=2, draft_len=2, tps=(1,))
    make_repo(engines[1], root / "repo")
    return root / "repo"


@pytest.mark.parametrize("model", sorted(contract.STOCK))
def test_every_stock_tensor_is_declared_alike(repo, model):
    cfg = (repo / model / "config.pbtxt").read_text()
    stock_in, stock_out = contract.STOCK[model]
    ours_in, ours_out = declared(cfg, "input"), declared(cfg, "output")
    missing = [t.name for t in stock_in if t.name not in ours_in] + [t.name for t in stock_out if t.name not in ours_out]
    assert missing == []
    for t in stock_in:
        o = ours_in[t.name]
        assert (o.dtype, o.dims) == (t.dtype, t.dims), t
        assert o.optional or not t.optional, f"{t.name} is optional in the stock model, required in ours"
    for t in stock_out:
        assert (ours_out[t.name].dtype, ours_out[t.name].dims) == (t.dtype, t.dims), t
    # our additions are optional: a stock client never has to send them
    extra_required = [n for n, o in ours_in.items() if n not in {t.name for t in stock_in} and not o.optional]
    assert extra_required == []


def test_ensemble_maps_every_input_it_declares(repo):
    cfg = (repo / "ensemble" / "config.pbtxt").read_text()
    mapped = set(re.findall(r'input_map\s+\{ key: "\w+"\s+value: "(\w+)" \}', cfg))
    assert set(declared(cfg, "input")) <= mapped  # none dropped on the way to the engine


def _inputs(**kw):
    base = {"input_ids": np.array([[5, 6, 7]], np.int32), "request_output_len": np.array([[4]], np.int32)}
    base.update({k: np.asarray(v) for k, v in kw.items()})
    return base


@pytest.mark.parametrize("name", sorted(_NEUTRAL))
def test_inputs_that_ask_for_nothing_are_accepted_and_others_refused_by_name(name):
    neutral = _NEUTRAL[name][0]
    dtype = np.bool_ if isinstance(neutral, bool) else np.float32 if isinstance(neutral, float) else np.int32
    parse_inputs(_inputs(**{name: np.array([[neutral]], dtype)}))
    other = (not neutral) if isinstance(neutral, bool) else neutral + 2
    with pytest.raises(UserError, match=rf"^{name}=.*cannot be honoured"):
        parse_inputs(_inputs(**{name: np.array([[other]], dtype)}))


@pytest.mark.parametrize("name", sorted(_UNSUPPORTED))
def test_unsupported_features_are_refused_by_name(name):
    with pytest.raises(UserError, match=rf"input '{name}': this engine does not support"):
        parse_inputs(_inputs(**{name: np.array([[1, 2]], np.float32)}))


def test_beam_only_knobs_bad_words_seeds_and_decoder_ids():
    p = parse_inputs(_inputs(len_penalty=[[1.3]], early_stopping=[[True]], beam_search_diversity_rate=[[0.5]],
                             random_seed=np.array([[9]], np.uint64), decoder_input_ids=np.array([[0]], np.int32),
                             embedding_bias=np.zeros((1, 0), np.float32)))
    assert p.spec.params.seed == 9  # v0.19.0's name
    assert parse_inputs(_inputs(seed=np.array([[4]], np.uint64),
                                random_seed=np.array([[9]], np.uint64))).spec.params.seed == 4
    with pytest.raises(UserError, match="bad_words cannot be honoured"):
        parse_inputs(_inputs(bad_words_list=np.array([[[7, 8], [2, -1]]], np.int32)))
    with pytest.raises(UserError, match="decoder-only engine"):
        parse_inputs(_inputs(decoder_input_ids=np.array([[3, 4]], np.int32)))


def test_exclude_input_in_output_follows_the_request_then_the_model():
    assert not parse_inputs(_inputs()).include_input  # the model's parameter (make-repo writes true)
    assert parse_inputs(_inputs(), exclude_input_in_output=False).include_input
    assert parse_inputs(_inputs(exclude_input_in_output=[[False]])).include_input
    assert not parse_inputs(_inputs(exclude_input_in_output=[[True]]), exclude_input_in_output=False).include_input
    # streamed responses carry new tokens only, as TensorRT-LLM's
    assert not parse_inputs(_inputs(exclude_input_in_output=[[False]], streaming=[[True]])).include_input
    p = parse_inputs(_inputs(return_num_input_tokens=[[True]], return_num_output_tokens=[[True]],
                             return_perf_metrics=[[True]]))
    assert p.count_input and p.count_output and p.perf_metrics


def test_a_batch_splits_into_rows_cut_to_their_lengths():
    """TensorRT-LLM's splitBatchInputsTensors (utils.cc @ c1e1963): row i of every input, input_ids cut to
    input_lengths[i]; streaming is the request's (row 0's); a batch needs input_lengths and one row per prompt."""
    batch = {"input_ids": np.array([[5, 6, 7], [8, 9, 0]], np.int32), "input_lengths": np.array([[3], [2]], np.int32),
             "request_output_len": np.array([[4], [6]], np.int32), "streaming": np.array([[True], [False]])}
    rows = [parse_inputs(r) for r in split_rows(batch)]
    assert [r.spec.prompt for r in rows] == [[5, 6, 7], [8, 9]]
    assert [r.spec.params.max_tokens for r in rows] == [4, 6] and all(r.streaming for r in rows)
    one = {"input_ids": batch["input_ids"][:1]}
    assert split_rows(one)[0] is one
    with pytest.raises(UserError, match="send input_lengths with one length per prompt"):
        split_rows({k: v for k, v in batch.items() if k != "input_lengths"})
    with pytest.raises(UserError, match="input 'request_output_len' has shape \\[1, 1\\].*batch of 2"):
        split_rows(dict(batch, request_output_len=np.array([[4]], np.int32)))


class _RecordingMetricsStub:
    """Stands in for ServingMetrics (whose families exist only inside Triton's Python backend): records the calls."""

    def __init__(self):
        self.outcomes, self.tokens = [], 0

    def step(self, new_tokens: int, generation_step: bool) -> None:
        self.tokens += new_tokens

    def finished(self, outcome: str) -> None:
        self.outcomes.append(outcome)

    def request_tokens(self, input_tokens: int, output_tokens: int) -> None:
        pass


class _RefusingSinkStub:
    """A response sender that refuses every send, as one whose client cancelled the request or went away may."""

    sends = 0

    def send(self, outputs, error, final, code="INVALID_ARG"):
        self.sends += 1
        raise RuntimeError("Unable to send response: the request was cancelled")

    def is_cancelled(self):
        return True


@pytest.mark.parametrize("streaming", [True, False])
def test_tokens_and_a_cancelled_outcome_are_counted_when_the_send_fails_with_stubbed_sink_and_metrics(streaming):
    """A client that cancels (the OpenAI frontend at a stop string) leaves a sender that may refuse the request's
    last responses: its tokens and its outcome are still counted."""
    import threading
    from types import SimpleNamespace

    from trt_redrafter.serving.engine_model import EngineModel, _Open

    model = EngineModel.__new__(EngineModel)  # the response path only: no engine, no scheduler
    model.decoupled, model.metrics, model._lock = True, _RecordingMetricsStub(), threading.Lock()
    parsed = parse_inputs({"input_ids": np.array([[1, 2, 3]], np.int32), "input_lengths": np.array([[3]], np.int32),
                           "request_output_len": np.array([[8]], np.int32),
                           "streaming": np.array([[streaming]], bool)})
    sink = _RefusingSinkStub()
    model._open = {7: _Open("r", sink, parsed, streaming, key=7)}
    seq = SimpleNamespace(output=[5, 6], finish_reason=None, sampling=SimpleNamespace(wants_logprobs=False),
                          stats=SimpleNamespace(acceptance_rate=0.0, accepted_draft_tokens=0, draft_tokens=0))
    req = SimpleNamespace(request_id=7, seq=seq)
    model._on_tokens(req, [5, 6], False)  # a step's tokens, refused (streaming) or held for the end
    seq.finish_reason = "cancelled"
    model._on_tokens(req, [], True)
    assert sink.sends == (2 if streaming else 1)
    assert model.metrics.outcomes == ["cancelled"] and model.metrics.tokens == 2
    assert 7 not in model._open  # and it is no longer polled
