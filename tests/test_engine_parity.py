"""Greedy ReDrafter == greedy AR == Hugging Face `generate`, token for token (fp32, CPU), and KV rewind exactness."""

from __future__ import annotations

import pytest
import torch

from engine_utils import OracleProposer, build_tiny_engines, greedy, hf_greedy, load_engine, random_prompts
from trt_redrafter.config import SamplingConfig
from trt_redrafter.runtime.generate import generate
from trt_redrafter.runtime.sequence import RequestSpec

MAX_NEW = 24
PROMPT_LENS = [5, 11, 3, 8, 14]  # unequal lengths, more prompts than max_batch_size=4 (admission mid-run)

CONFIGS = {
    # name: (make-tiny sizes, num_beams, draft_len_per_beam)
    "gqa-nb6-dl4-rnn": (dict(num_heads=4, num_kv_heads=2, rnn=True), 6, 4),
    "mha-nb1-dl1-inputproj": (dict(num_heads=4, num_kv_heads=4, rnn=False, exit_dim=96), 1, 1),
    "mqa-nb6-dl1": (dict(num_heads=4, num_kv_heads=1, rnn=True), 6, 1),
    "gqa-nb1-dl4-cumsum": (dict(num_heads=4, num_kv_heads=2, rnn=False), 1, 4),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    sizes, nb, dl = CONFIGS[request.param]
    seed = sorted(CONFIGS).index(request.param) + 11
    base, engines = build_tiny_engines(tmp_path_factory.mktemp(request.param), seed=seed, num_beams=nb,
                                       draft_len=dl, **sizes)
    engine = load_engine(engines[1])
    prompts = random_prompts(engine.cfg.checkpoint.model.vocab_size, PROMPT_LENS, seed)
    ar = generate(engine, prompts, greedy(MAX_NEW), mode="ar")
    return dict(base=base, engine_dir=engines[1], prompts=prompts, ar=[r.output_ids for r in ar])


def test_greedy_ar_equals_hf_generate(tiny):
    for prompt, out in zip(tiny["prompts"], tiny["ar"]):
        assert out == hf_greedy(tiny["base"], prompt, MAX_NEW)


def test_greedy_redrafter_equals_ar_with_its_own_drafter(tiny):
    engine = load_engine(tiny["engine_dir"])
    res = generate(engine, tiny["prompts"], greedy(MAX_NEW), mode="redrafter")
    assert [r.output_ids for r in res] == tiny["ar"]
    assert all(r.steps > 0 and r.draft_tokens == r.steps * engine.tree.draft_len_per_beam for r in res)
    assert engine.cache.used_blocks == 0


@pytest.mark.parametrize("corrupt_every", [0, 2])
def test_greedy_redrafter_equals_ar_when_drafts_are_accepted(tiny, corrupt_every):
    """An oracle drafter forces long acceptances (and, corrupted, partial ones) through verify/accept/rewind."""
    engine = load_engine(tiny["engine_dir"],
                         OracleProposer(tiny["engine_dir"], dict(enumerate(tiny["ar"])), corrupt_every=corrupt_every))
    res = generate(engine, tiny["prompts"], greedy(MAX_NEW), mode="redrafter")
    assert [r.output_ids for r in res] == tiny["ar"]
    accepted = sum(r.accepted_draft_tokens for r in res)
    assert accepted > 0
    if corrupt_every == 0 and engine.tree.draft_len_per_beam > 1:
        assert min(r.tokens_per_step for r in res) > 1.5  # the whole oracle beam is taken almost every step


def test_kv_rewind_matches_recomputation(tiny):
    """After accepted steps, the next AR logits equal those of a fresh prompt pass over prompt + output."""
    engine = load_engine(tiny["engine_dir"], OracleProposer(tiny["engine_dir"], {0: tiny["ar"][0]}, corrupt_every=2))
    s = engine.new_sequence(RequestSpec(tiny["prompts"][0], greedy(MAX_NEW)))
    while len(s.output) < 10:
        engine.step([s])
    assert s.stats.accepted_draft_tokens > 0
    s.mode = "ar"
    history = tiny["prompts"][0] + s.output  # the continued step feeds output[-1] at position len(history) - 1
    _, logits_cont = _last_logits(engine, s)

    fresh = load_engine(tiny["engine_dir"])
    f = fresh.new_sequence(RequestSpec(history, greedy(4)))
    _, logits_ref = _last_logits(fresh, f)
    torch.testing.assert_close(logits_cont, logits_ref, rtol=1e-4, atol=1e-4)


def _last_logits(engine, seq):
    """Run one step and capture the logits the engine computed for `seq`'s last position."""
    captured = {}
    orig = engine.model.logits

    def spy(hidden):
        out = orig(hidden)
        captured["logits"] = out.reshape(-1, out.shape[-1])[-1].float().clone()
        return out

    engine.model.logits = spy
    try:
        engine.step([seq])
    finally:
        engine.model.logits = orig
    return seq, captured["logits"]


def test_phase_profile_times_whole_trees_where_the_policy_takes_ar_steps(tiny):
    """bench-engine's phase profile: where the policy takes AR steps only (here its cost model makes every tree step
    dear), the profile times steps that verify whole trees instead of timing nothing, and says so."""
    from trt_redrafter.bench.measure import phase_profile
    from trt_redrafter.runtime.step import PHASES

    engine = load_engine(tiny["engine_dir"], speculate="auto")
    costs = engine.policy.costs
    costs.tree = [[[100 * ms for ms in row] for row in ctx] for ctx in costs.tree]
    own = engine.policy.speculation
    phases, under = phase_profile(engine, tiny["prompts"][:1], greedy(MAX_NEW))
    assert under == "full" and set(phases) == set(PHASES) and all(t > 0 for t in phases.values())
    assert engine.policy.speculation is own and not engine.timer.enabled
    assert engine.step_times.widths[0] > 0  # the policy's own run took AR steps


def test_phase_profile_times_every_phase_and_changes_no_token(tiny):
    """--profile-phases runs verify/accept/rewind/draft/pack as separate units: same tokens, every phase timed."""
    from trt_redrafter.runtime.step import PHASES

    engine = load_engine(tiny["engine_dir"], profile_phases=True)
    res = generate(engine, tiny["prompts"], greedy(MAX_NEW), mode="redrafter")
    assert [r.output_ids for r in res] == tiny["ar"]
    times = engine.timer.mean_ms()
    assert engine.timer.steps == engine.step_times.steps["tree"] > 0  # every batched ReDrafter step
    assert set(times) == set(PHASES) and all(t > 0 for t in times.values())
    # a sampled step's accept phase (it draws noise) runs in a unit of its own, compiled as one that draws
    generate(engine, tiny["prompts"][:1], [SamplingConfig(max_tokens=8, temperature=0.8, seed=1)], mode="redrafter")
    draws = {key[2] for key, unit in engine.launcher._units.items() if key[0] == "accept" and unit.draws == key[2]}
    assert draws == {False, True}


def test_the_cost_model_times_whole_steps_under_profile_phases(tiny):
    """The step cost model (measured, or probed against its cache) times the steps every run takes, not the phases'
    separate units: a model measured under --profile-phases is cached beside the engine for runs without it."""
    engine = load_engine(tiny["engine_dir"], profile_phases=True)
    engine.timer.reset()
    model = engine.cost_model()
    assert model.tree[0][0][0] > 0
    assert engine.timer.steps == engine.timer.discarded == 0  # no step went through the phase units
    assert engine.timer.enabled  # ... and the engine's own steps still do
    res = generate(engine, tiny["prompts"][:1], greedy(MAX_NEW), mode="redrafter")
    assert res[0].output_ids == tiny["ar"][0] and engine.timer.steps > 0


def test_a_profiled_step_during_which_a_unit_compiled_is_not_counted():
    """The phase profile's units compile on the first step of each new shape (a width first seen): that step's time is
    the compiler's. `_builds` sees the compile, and the timer drops the step."""
    import time

    import torch

    from trt_redrafter.runtime.launch import _builds
    from trt_redrafter.runtime.timing import PhaseTimer

    before = _builds(None)
    torch.compile(lambda x: x * 2 + 1)(torch.ones(3))
    assert _builds(None) > before
    timer = PhaseTimer(torch.device("cpu"), enabled=True)
    with timer.phase("verify"):
        time.sleep(0.05)  # a compile
    timer.discard_step()
    timer.end_step()
    with timer.phase("verify"):
        pass
    timer.end_step()
    assert timer.steps == 1 and timer.discarded == 1 and timer.mean_ms()["verify"] < 10
