"""`trt-redrafter bench-engine` (trt_redrafter/bench/engine_bench.py): the order its modes run in, the spread its
speedups report, baselines that crash in their own process, and a whole run on models/small."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from engine_utils import SMALL, build_small_engine, greedy, load_engine
from trt_redrafter import cpu
from trt_redrafter.bench.baselines import Baseline, BaselineJob, run_baselines
from trt_redrafter.bench.measure import RatioSummary, phase_profile, round_schedule
from trt_redrafter.cli import main as cli



def test_round_schedule_alternates_modes_per_group_and_rotates_the_order():
    two = round_schedule(["ar", "redrafter"], groups=3, rounds=2)
    assert two == [[["ar", "redrafter"], ["redrafter", "ar"], ["ar", "redrafter"]],
                   [["redrafter", "ar"], ["ar", "redrafter"], ["redrafter", "ar"]]]
    modes = ["ar", "redrafter", "ngram", "mixed"]
    sched = round_schedule(modes, groups=2, rounds=4)
    for r, orders in enumerate(sched):
        for g, order in enumerate(orders):
            assert sorted(order) == sorted(modes)  # every mode once on every group
            i = modes.index(order[0])
            assert order == modes[i:] + modes[:i]  # a rotation: AR keeps its neighbours
            assert order[0] == modes[(r + g) % len(modes)]
        assert orders[0][0] != orders[1][0]  # the next group starts with another mode
    for g in range(2):  # over the rounds every mode leads each group once
        assert sorted(sched[r][g][0] for r in range(4)) == sorted(modes)
    # one group per round (batch size >= prompts): the order still turns from round to round
    assert [s[0][0] for s in round_schedule(["ar", "redrafter"], groups=1, rounds=4)] == ["ar", "redrafter"] * 2


@pytest.mark.parametrize("linear", ["torch", "onednn", "avx512"])
def test_the_memory_roofline_counts_every_base_linear_layer_whatever_its_kernel(tmp_path, linear):
    """The AR step's floor holds the base's linear layers as the engine keeps them: fp32 weights, oneDNN's packed ones
    (opaque mkldnn tensors: bench-engine once printed 0.0 MB for them) or this project's packed panels."""
    if linear == "avx512" and not cpu.available(torch.float32):
        pytest.skip(cpu.unavailable_reason(torch.float32))
    from engine_utils import build_tiny_engines, load_engine
    from trt_redrafter.bench.engine_bench import memory_roofline
    from trt_redrafter.model.linear import Linear

    engine = load_engine(build_tiny_engines(tmp_path, seed=0, num_beams=2, draft_len=2)[1][1], linear=linear)
    layers = [m for m in engine.model.modules() if isinstance(m, Linear)]
    assert layers and {m.impl for m in layers} == {linear}
    floats = sum(m.in_features * m.out_features for m in layers) * 4 / 1e6
    roof = memory_roofline(engine, torch.device("cpu"), buffer_mb=64)
    assert floats <= roof["weight_mb"] <= 1.05 * floats  # packed panels may pad the last one
    assert roof["floor_ms"] == pytest.approx(roof["weight_mb"] / roof["read_gb_s"])


def test_ratio_summary_reports_how_far_the_rounds_disagree():
    s = RatioSummary.of([1.30, 1.10, 1.50, 1.20, 1.40])
    assert (s.median, s.min, s.max, s.rounds) == pytest.approx((1.30, 1.10, 1.50, 5))
    assert (s.q1, s.q3, s.iqr) == pytest.approx((1.20, 1.40, 0.20))  # numpy's linear percentiles
    assert not s.straddles_one
    assert s.describe() == "1.30x (rounds 1.10-1.50, IQR 0.20, n=5)"
    split = RatioSummary.of([0.9, 1.2, 1.05])
    assert split.straddles_one and "the rounds disagree on which is faster" in split.describe()
    assert RatioSummary.of([2.0]).iqr == 0.0


FAKE_BASELINES = '''
import os, signal

def segfault_at_first_completion(job, **options):  # what llama-cpp-python's Q8_0 does on some CPUs
    os.kill(os.getpid(), signal.SIGSEGV)

def raises(job, **options):
    raise RuntimeError("no such model file")

def echo(job, shift=0, **options):
    return [{"name": "echo", "ms_per_token": 2.0, "outputs": [[t + shift for t in p] for p in job.prompts],
             "options": {"shift": shift}}]
'''


def test_a_fake_baseline_that_segfaults_costs_only_its_own_row_with_the_reason(tmp_path, monkeypatch):
    """Each baseline runs in a process of its own: a simulated SIGSEGV (a fake baseline, not llama.cpp) and an
    exception each leave an error row saying why, and the baselines around them still report."""
    (tmp_path / "fake_baselines.py").write_text(textwrap.dedent(FAKE_BASELINES))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    job = BaselineJob(prompts=[[5, 6], [7]], max_tokens=4, repeats=1, threads=1)
    rows = run_baselines([Baseline(("echo",), "fake_baselines:echo"),
                          Baseline(("llama.cpp_q8_0",), "fake_baselines:segfault_at_first_completion"),
                          Baseline(("broken",), "fake_baselines:raises"),
                          Baseline(("echo",), "fake_baselines:echo", {"shift": 1})],
                         job, reference=[[5, 6], [7]], ar_ms=1.0)
    assert [r.name for r in rows] == ["echo", "llama.cpp_q8_0", "broken", "echo"]
    ok, crashed, broken, off = rows
    assert crashed.error == "exited with signal 11 (SIGSEGV)" and crashed.ms_per_token is None
    assert broken.error == "RuntimeError: no such model file"
    assert ok.error is None and ok.greedy_outputs_equal and ok.outputs_equal_to_ar == "2/2"
    assert ok.speedup == pytest.approx(0.5)
    assert off.greedy_outputs_equal is False and off.outputs_equal_to_ar == "0/2"
    assert off.to_dict()["shift"] == 1 and "outputs" not in off.to_dict() and "error" not in off.to_dict()
    assert crashed.to_dict() == {"ms_per_token": None, "greedy_outputs_equal": None, "outputs_equal_to_ar": None,
                                 "speedup": None, "error": "exited with signal 11 (SIGSEGV)"}


@pytest.fixture(scope="module")
def small_engine(tmp_path_factory) -> Path:
    if not (SMALL / "drafter" / "model.safetensors").is_file():
        pytest.skip("models/small not trained")
    return build_small_engine(tmp_path_factory.mktemp("bench-engine"), num_beams=2, draft_len=3, max_batch_size=4,
                              max_input_len=64, max_seq_len=128)



def test_the_phase_breakdown_leaves_what_the_policy_measured_of_the_decode(small_engine):
    """bench-engine's phase breakdown runs last, each phase of a step its own synchronized unit: steps several times
    slower than the decode's. What the policy measured of the decode (the running scales, the host's times between
    steps, the switches between step kinds: the JSON's step_scale, between_steps_ms, switch_ms) is what it was before
    it, while the breakdown's steps did run and were timed."""
    engine = load_engine(small_engine, speculate="auto")
    pol = engine.policy
    pol.step_scale, pol.between, pol.switch = [1.1, 1.2], [0.3, 0.4], [0.5, 0.6]
    phases, _ = phase_profile(engine, [[5, 6, 7, 8]], greedy(12), last=False)
    assert phases and all(ms > 0 for ms in phases.values())
    assert (pol.step_scale, pol.between, pol.switch) == ([1.1, 1.2], [0.3, 0.4], [0.5, 0.6])

def test_bench_engine_end_to_end_on_models_small(small_engine, tmp_path, capsys):
    """The subcommand on a trained small pair: AR and ReDrafter give the same greedy tokens, ReDrafter's drafts are
    accepted, HF generate (its own process) agrees with AR, a llama.cpp row that cannot run says why, the timed runs
    take whole steps under --profile-phases, and the last stdout line is the JSON document."""
    prompts = tmp_path / "code.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in (
        "def heappush(heap, item):\n", "class Fraction(numbers.Rational):\n", "import os\n\ndef main(", "for i in")))
    bad_gguf = tmp_path / "not-a-model.gguf"
    bad_gguf.write_bytes(b"not a gguf file")
    assert cli(["bench-engine", "--engine", str(small_engine), "--prompts", str(prompts), "--num-prompts", "4",
                "--chat-template", "none", "--max-tokens", "24", "--repeats", "2", "--batch-size", "1,2",
                "--modes", "ar,redrafter", "--compile", "off", "--speculate", "full", "--threads", "1",
                "--profile-phases", "--hf-model", str(SMALL / "base"), "--llama-cpp", str(bad_gguf),
                "--llama-cpp-types", "q8_0"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    doc = json.loads(out.strip().splitlines()[-1])
    # --profile-phases: the phase breakdown from a run of its own, the timed steps whole
    assert doc["runtime"]["profile_phases"] is False and "its timed runs" in captured.err
    assert [(r["batch_size"], r["mode"]) for r in doc["rows"]] == [(1, "ar"), (1, "redrafter"), (2, "ar"),
                                                                   (2, "redrafter")]
    for r in doc["rows"]:
        assert r["greedy_outputs_equal"] is True, r
        assert len(r["round_speedups"]) == 2 and len(r["group_speedups"]) == 2 * 4 // r["batch_size"]
        assert r["speedup_min"] <= r["speedup"] <= r["speedup_max"]
        if r["mode"] == "redrafter":
            assert r["acceptance_rate"] > 0 and r["tokens_per_step"] > 1.2, r
            assert set(r["steps_by_width"]) == {str(1 + 2 * 3)}  # speculate full: every tree whole (2 beams x 3)
    assert doc["hf"]["hf_greedy"]["outputs_equal_to_ar"] == "4/4" and doc["hf"]["hf_greedy"]["speedup"] > 0
    assert doc["hf"]["hf_prompt_lookup"]["prompt_lookup_num_tokens"] == 10
    assert doc["hf"]["llama.cpp_q8_0"]["error"] and doc["hf"]["llama.cpp_q8_0"]["ms_per_token"] is None
    assert set(doc["phases_ms"]) == {"verify", "accept", "rewind", "draft", "pack"}
    if cpu.available(torch.float32):  # the CPU kernels: the drafter's search is one call (cpu/draft.cpp)
        assert doc["drafting"].startswith("one kernel call") and "beam search: one kernel call" in out
    # the machine the figures came from, with the instruction sets they depend on
    assert doc["machine"]["cpu"] and f"CPU: {doc['machine']['cpu']}" in out
    assert ("avx512f" in doc["machine"]["features"]) == cpu.available(torch.float32)
    assert "| 1 | redrafter |" in out and "| 1 | llama.cpp_q8_0 | failed: " in out
