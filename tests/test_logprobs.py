"""Log-probabilities of output tokens (decoding/logprobs.py, SamplingConfig.logprobs / top_logprobs).

The reference is Hugging Face: `log_softmax` of the same model's logits over prompt + output, at each output position.
Through the engine (AR, ReDrafter with drafts accepted, sampled, with prefix reuse and chunked prefill, compiled,
TP 2 under mpirun), `trt-redrafter run --logprobs`, and the Triton model's tensors; the OpenAI API's are in
test_openai.py.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from engine_utils import (OracleProposer, build_tiny_engines, check_logprobs_against_hf, load_engine, random_prompts,
                          run_json)
from trt_redrafter.config import SamplingConfig
from trt_redrafter.decoding import logprobs as lp
from trt_redrafter.errors import UserError
from trt_redrafter.runtime.generate import generate
from trt_redrafter.runtime.sequence import Draft
from trt_redrafter.runtime.step import SCORE_SCALE
from trt_redrafter.serving.engine_model import logprob_tensors, parse_inputs

VOCAB = 512
TOP = 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base, engines = build_tiny_engines(tmp_path_factory.mktemp("logprobs"), seed=3, num_beams=4, draft_len=3,
                                       vocab_size=VOCAB, max_seq_len=200, kv_block_size=16, tps=(1, 2))
    return base, engines


PROMPTS = random_prompts(VOCAB, [7, 20, 40], seed=1)
GREEDY = SamplingConfig(max_tokens=16, logprobs=True, top_logprobs=TOP)


def _check_against_hf(base, prompt: list[int], result, top: int = TOP) -> None:
    check_logprobs_against_hf(base, prompt, result, top, atol=1e-4)


class _LaterBeamsFirst:
    """An oracle whose trees score later beams higher, wherever its right beam lies: the accepted path's tree indices
    are then not 0, 1, 2, ... (the tree numbers nodes best first), so each token's logits must be found along it."""

    def __init__(self, oracle):
        self.oracle = oracle

    def __getattr__(self, name):
        return getattr(self.oracle, name)

    def compose(self, seq, device=None):
        d = self.oracle.compose(seq, device)
        nb = len(d.rows)
        return Draft(d.rows, [[-(nb - i) * SCORE_SCALE] * len(sc) for i, sc in enumerate(d.scores)])


def _ar_and_redrafter(engine_dir, params, **runtime):
    """AR, then ReDrafter drafting AR's own continuation (every other tree wrong somewhere: partial acceptances)."""
    ar = generate(load_engine(engine_dir, **runtime), PROMPTS, params, "ar")
    oracle = _LaterBeamsFirst(OracleProposer(engine_dir, {i: r.output_ids for i, r in enumerate(ar)}, corrupt_every=2))
    rd = generate(load_engine(engine_dir, oracle, **runtime), PROMPTS, params, "redrafter")
    assert sum(r.accepted_draft_tokens for r in rd) > 0
    return ar, rd


def test_fixed_point_round_trip_is_exact_for_float32():
    """Exact from 2**-8 down in magnitude, within 2**-33 above (fixed point at 2**-32)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 50, generator=g) * 12
    tokens = torch.randint(0, 50, (2, 3), generator=g)
    tokens[0, 0] = logits[0, 0].argmax()  # a log-probability near 0
    cols = lp.encode(logits, tokens, 4)
    assert cols.shape == (2, 3 * lp.columns(4)) and cols.dtype == torch.long
    ref = torch.log_softmax(logits, -1).double()
    for b in range(2):
        out = lp.decode(cols[b].tolist(), 3, 4, 2)
        want = ref[b].gather(-1, tokens[b][:, None])[:, 0]
        got = torch.tensor([t.logprob for t in out], dtype=torch.float64)
        assert ((got - want).abs() <= 2.0 ** -33).all()
        assert (got[want.abs() >= 2.0 ** -8] == want[want.abs() >= 2.0 ** -8]).all()
        assert [[i for i, _ in t.top] for t in out] == ref[b].topk(2).indices.tolist()
        assert ((torch.tensor([[x for _, x in t.top] for t in out]).double() - ref[b].topk(2).values).abs()
                <= 2.0 ** -33).all()


@pytest.mark.core
def test_greedy_logprobs_equal_hf_and_redrafter_reports_what_ar_reports(tiny):
    base, engines = tiny
    ar, rd = _ar_and_redrafter(engines[1], GREEDY)
    for p, a, r in zip(PROMPTS, ar, rd):
        assert r.output_ids == a.output_ids
        _check_against_hf(base, p, a)
        _check_against_hf(base, p, r)
        # the verify pass scores an accepted token at AR's very position and context
        torch.testing.assert_close(torch.tensor([t.logprob for t in r.logprobs]),
                                   torch.tensor([t.logprob for t in a.logprobs]), atol=1e-5, rtol=0)


def test_sampled_tokens_report_the_models_distribution_not_the_sampling_one(tiny):
    """Temperature, top-k and top-p shape the draw; the log-probability is the model's own (vLLM's raw_logprobs)."""
    base, engines = tiny
    params = SamplingConfig(max_tokens=16, temperature=0.7, top_k=20, seed=5, logprobs=True, top_logprobs=TOP)
    ar, rd = _ar_and_redrafter(engines[1], params)
    for p, a, r in zip(PROMPTS, ar, rd):
        assert r.output_ids == a.output_ids  # `exact` acceptance: the same draws
        _check_against_hf(base, p, a)
        _check_against_hf(base, p, r)


def test_only_the_requests_that_ask_get_them_and_as_many_as_they_ask(tiny):
    base, engines = tiny
    params = [SamplingConfig(max_tokens=10), SamplingConfig(max_tokens=10, logprobs=True),
              SamplingConfig(max_tokens=10, top_logprobs=5)]
    out = generate(load_engine(engines[1]), PROMPTS, params, "redrafter")
    assert out[0].logprobs == []
    assert len(out[1].logprobs) == 10 and all(t.top == () for t in out[1].logprobs)
    _check_against_hf(base, PROMPTS[2], out[2], top=5)
    plain = generate(load_engine(engines[1]), PROMPTS, SamplingConfig(max_tokens=10), "redrafter")
    assert [r.output_ids for r in plain] == [r.output_ids for r in out]  # asking changes no token


def test_prefix_reuse_and_chunked_prefill_give_the_same_logprobs(tiny):
    """A second turn over the first turn's answer (its K/V reused, written by decode steps) and a prompt prefilled in
    16-token chunks report what a cold, whole prefill reports."""
    base, engines = tiny
    first = generate(load_engine(engines[1], kv_cache_reuse=False), PROMPTS[2:], GREEDY, "ar")[0]
    turn2 = PROMPTS[2] + first.output_ids + [7, 8, 9]
    cold = generate(load_engine(engines[1], kv_cache_reuse=False, enable_chunked_context=False), [turn2], GREEDY,
                    "redrafter")[0]
    engine = load_engine(engines[1], max_num_tokens=16)
    generate(engine, PROMPTS[2:], GREEDY, "ar")
    warm = generate(engine, [turn2], GREEDY, "redrafter")[0]
    assert warm.cached_tokens > 0 and warm.output_ids == cold.output_ids
    torch.testing.assert_close(torch.tensor([t.logprob for t in warm.logprobs]),
                               torch.tensor([t.logprob for t in cold.logprobs]), atol=1e-5, rtol=0)
    _check_against_hf(base, turn2, warm)


def test_asking_for_more_top_logprobs_than_the_engine_allows_is_refused(tiny):
    engine = load_engine(tiny[1][1], max_logprobs=4)
    with pytest.raises(UserError, match=r"top_logprobs=5 is above this engine's limit of 4 \(its max_logprobs\)"):
        generate(engine, PROMPTS[:1], SamplingConfig(max_tokens=4, top_logprobs=5), "redrafter")
    with pytest.raises(UserError, match="top_logprobs"):
        SamplingConfig(top_logprobs=-1).validate()


@pytest.mark.slow
@pytest.mark.timeout(900)  # inductor compiles the steps: minutes on 2 cores shared with another worker (CI's -n 2)
def test_compiled_steps_report_the_eager_logprobs(tiny):
    """The tree step's log-probability variant under inductor, compiled when first asked for (no warm-up: the only
    graph compiled is the one this test needs)."""
    from trt_redrafter.config import RuntimeConfig
    from trt_redrafter.model.tp import Dist
    from trt_redrafter.runtime.engine import Engine

    base, engines = tiny
    eager = generate(load_engine(engines[1]), PROMPTS, GREEDY, "redrafter")
    engine = Engine.load(engines[1], Dist(0, 1, torch.device("cpu")),
                         RuntimeConfig(device="cpu", compile="inductor", speculate="full"), warmup=False)
    compiled = generate(engine, PROMPTS, GREEDY, "redrafter")
    for p, e, c in zip(PROMPTS, eager, compiled):
        assert c.output_ids == e.output_ids
        _check_against_hf(base, p, c)


@pytest.mark.mpi
def test_tp2_reports_the_tp1_logprobs(tiny):
    """`trt-redrafter run --json --top-logprobs` under real mpirun at TP 2 against TP 1 (in process)."""
    _, engines = tiny
    one = generate(load_engine(engines[1]), PROMPTS[:2], SamplingConfig(max_tokens=12, top_logprobs=TOP), "redrafter")
    two = run_json(engines[2], PROMPTS[:2], "redrafter", ("--top-logprobs", str(TOP), "--speculate", "full"),
                   max_new=12, full=True)
    for a, b in zip(one, two):
        assert a.output_ids == b["output_ids"] and len(b["logprobs"]) == 12
        np.testing.assert_allclose([t["logprob"] for t in b["logprobs"]], [t.logprob for t in a.logprobs], atol=1e-4)
        assert [[i for i, _ in t["top"]] for t in b["logprobs"]] == [[i for i, _ in t.top] for t in a.logprobs]


def test_the_run_command_prints_a_logprob_table(tiny, capsys):
    from trt_redrafter.cli import main as cli

    assert cli(["run", "--engine", str(tiny[1][1]), "--prompt-ids", ",".join(map(str, PROMPTS[0])),
                "--max-tokens", "5", "--ignore-eos", "--top-logprobs", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    table = lines[lines.index(next(x for x in lines if x.split()[:3] == ["#", "token", "logprob"])):]
    assert len(table) == 1 + 5
    for i, row in enumerate(table[1:]):  # position, token, its log-probability, then the two most likely tokens'
        assert row.split()[0] == str(i) and len(re.findall(r" -?\d+\.\d{4}\b", row)) == 1 + 2, row


# ---- the Triton model's tensors --------------------------------------------------------------------------------------
def test_triton_inputs_ask_for_logprobs_in_tensorrt_llms_names():
    base = {"input_ids": np.array([[5, 6, 7]], np.int32), "request_output_len": np.array([[4]], np.int32)}
    assert not parse_inputs(base).spec.params.wants_logprobs
    asked = parse_inputs({**base, "return_log_probs": np.array([[True]])}).spec.params
    assert asked.logprobs and asked.top_logprobs == 0
    assert parse_inputs({**base, "top_logprobs": np.array([[3]], np.int32)}).spec.params.top_logprobs == 3
    with pytest.raises(UserError, match="top_logprobs"):
        parse_inputs({**base, "top_logprobs": np.array([[-2]], np.int32)})


def test_triton_tensors_have_tensorrt_llms_shapes():
    tokens = [lp.TokenLogprob(-0.5, ((1, -0.5), (2, -1.5))), lp.TokenLogprob(-0.25, ((3, -0.25), (1, -2.0))),
              lp.TokenLogprob(-1.0, ((4, -0.75), (5, -1.0)))]
    out = logprob_tensors(tokens, 1, 2, 2)  # a streamed response with the second and third tokens
    # output_log_probs holds every output token's so far, as TensorRT-LLM's streamed responses do
    assert out["output_log_probs"].shape == (1, 1, 3) and out["output_log_probs"].tolist() == [[[-0.5, -0.25, -1.0]]]
    assert out["cum_log_probs"].shape == (1, 1) and out["cum_log_probs"][0, 0] == pytest.approx(-1.75)
    assert out["top_token_ids"].tolist() == [[[3, 1], [4, 5]]] and out["top_log_probs"].shape == (1, 2, 2)
    assert "top_token_ids" not in logprob_tensors(tokens, 0, 3, 0)
