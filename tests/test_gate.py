"""The perf gate on recorded documents: identical results pass; a doctored regression of each rule fails with a
report that says why; bad input exits 2; --update-baseline writes atomically."""

from __future__ import annotations

import copy
import json

import pytest

from trt_redrafter.bench.gate import GateConfig, evaluate
from trt_redrafter.bench.harness import combine_repeats
from trt_redrafter.bench.report import SCHEMA
from trt_redrafter.cli import main as cli
from trt_redrafter.errors import UserError


def make_doc(ar_tpot=10.0, rd_tpot=5.0, rd_tps=3.2, errors=0, tps=(1, 2), qps=(1.0,), repeats=3) -> dict:
    runs = []
    for r in range(repeats):
        wobble = 1 + 0.02 * (r - 1)  # machine drift: hits both modes of a repeat alike
        for tp in tps:
            for q in qps:
                for mode, tpot, tok in (("ar", ar_tpot, 1.0), ("redrafter", rd_tpot, rd_tps)):
                    m = {"tpot_ms": {"median": tpot * wobble}, "tokens_per_step": tok,
                         "errors": errors if (mode == "redrafter" and r == 0) else 0,
                         "error_samples": ["server said no"] if errors and mode == "redrafter" and r == 0 else []}
                    runs.append({"repeat": r, "qps": q, "tp": tp, "mode": mode, "metrics": m})
    cfg = {"dataset": "q.jsonl", "chat_template": "auto", "max_tokens": 64, "ignore_eos": True, "temperature": 0.0,
           "num_requests": 8, "warmup": 1, "seed": 0, "repeats": repeats}
    return {"schema": SCHEMA, "config": cfg, "engines": {}, "prompts": {"sha256": "abc"}, "runs": runs,
            **combine_repeats(runs)}


def lines_for(report, rule, verdict):
    return [c.line() for c in report.checks if c.rule == rule and c.line().startswith(verdict)]


def test_identical_results_pass():
    rep = evaluate(make_doc(), make_doc(), GateConfig())
    assert rep.passed, rep.text()
    assert {c.rule for c in rep.checks} == {"speedup", "tokens_per_step", "errors"}
    assert len(rep.checks) == 2 * (1 + 2 + 1)  # per (tp, qps): speedup, tokens/step x 2 modes, errors
    assert rep.text().endswith("gate PASSED: 8/8 checks pass")


def test_machine_drift_alone_passes():
    slower = make_doc(ar_tpot=13.0, rd_tpot=6.5)  # everything 30% slower, same ratio
    assert evaluate(make_doc(), slower, GateConfig()).passed


def test_speedup_drop_fails_and_says_why():
    rep = evaluate(make_doc(), make_doc(rd_tpot=6.0), GateConfig(speedup_margin=0.10))  # 2.0x -> 1.67x
    assert not rep.passed
    bad = lines_for(rep, "speedup", "FAIL")
    assert len(bad) == 2 and "ReDrafter lost speedup over AR" in bad[0] and "-16.7%" in bad[0]
    assert ">= 1.8" in bad[0] and "tp1 qps1" in bad[0]
    assert "failing: speedup" in rep.text()
    assert evaluate(make_doc(), make_doc(rd_tpot=5.4), GateConfig(speedup_margin=0.10)).passed  # -7.4%: noise


def test_tokens_per_step_change_fails_both_ways():
    rep = evaluate(make_doc(), make_doc(rd_tps=3.1), GateConfig())
    bad = lines_for(rep, "tokens_per_step", "FAIL")
    assert len(bad) == 2 and all("redrafter" in b and "acceptance dropped" in b for b in bad)
    assert "-3.12%" in bad[0]
    assert not evaluate(make_doc(), make_doc(rd_tps=3.3), GateConfig()).passed
    assert evaluate(make_doc(), make_doc(rd_tps=3.22), GateConfig()).passed  # +0.6% < 1%


def test_errors_fail():
    rep = evaluate(make_doc(), make_doc(errors=2), GateConfig())
    bad = lines_for(rep, "errors", "FAIL")
    assert len(bad) == 2 and "2 failed request(s): server said no" in bad[0]
    assert [c.rule for c in rep.checks if not c.passed] == ["errors", "errors"]


def test_missing_point_fails():
    res = make_doc(tps=(1,))
    rep = evaluate(make_doc(), res, GateConfig())
    assert not rep.passed
    assert any("tp2" in c.point and not c.passed for c in rep.checks)


def test_incomparable_runs_are_bad_input():
    res = make_doc()
    res["config"]["max_tokens"] = 32
    with pytest.raises(UserError, match="max_tokens: baseline 64, results 32"):
        evaluate(make_doc(), res, GateConfig())
    res = make_doc()
    res["prompts"]["sha256"] = "def"
    with pytest.raises(UserError, match="prompt set differs"):
        evaluate(make_doc(), res, GateConfig())


def test_improvement_is_noted_not_failed():
    rep = evaluate(make_doc(), make_doc(rd_tpot=4.0), GateConfig())
    assert rep.passed and any("improved" in n and "--update-baseline" in n for n in rep.notes)


def test_cli_exit_codes_and_update_baseline(tmp_path, capsys):
    base, res, cfg = tmp_path / "base.json", tmp_path / "res.json", tmp_path / "gate.yaml"
    base.write_text(json.dumps(make_doc()))
    res.write_text(json.dumps(make_doc(rd_tpot=7.0)))
    cfg.write_text("gate:\n  speedup_margin: 0.5\n")
    assert cli(["gate", "--baseline", str(base), "--results", str(res)]) == 1
    assert "FAIL  speedup" in capsys.readouterr().out
    assert cli(["gate", "--baseline", str(base), "--results", str(res), "--config", str(cfg)]) == 0  # 50% margin
    assert cli(["gate", "--baseline", str(tmp_path / "nope.json"), "--results", str(res)]) == 2
    (tmp_path / "junk.json").write_text("{not json")
    assert cli(["gate", "--baseline", str(tmp_path / "junk.json"), "--results", str(res)]) == 2
    (tmp_path / "other.json").write_text('{"schema": "x"}')
    assert cli(["gate", "--baseline", str(base), "--results", str(tmp_path / "other.json")]) == 2
    cfg.write_text("gate:\n  speedup_margin: 2\n")
    assert cli(["gate", "--baseline", str(base), "--results", str(res), "--config", str(cfg)]) == 2
    capsys.readouterr()
    doc = make_doc(rd_tpot=7.0)
    doc["runs"][0]["requests"] = [{"index": 0}]
    res.write_text(json.dumps(doc))
    assert cli(["gate", "--baseline", str(base), "--results", str(res), "--update-baseline"]) == 0
    assert "updated" in capsys.readouterr().out
    new = json.loads(base.read_text())
    assert new["speedups"] == json.loads(res.read_text())["speedups"] and "requests" not in new["runs"][0]
    assert not list(tmp_path.glob(".base.json.tmp-*"))
    assert cli(["gate", "--baseline", str(base), "--results", str(res)]) == 0


def test_sampled_runs_skip_tokens_per_step():
    b, r = make_doc(), make_doc(rd_tps=2.0)
    for d in (b, r):
        d["config"]["temperature"] = 0.7
    rep = evaluate(b, r, GateConfig())
    assert rep.passed and not [c for c in rep.checks if c.rule == "tokens_per_step"]
    assert copy.deepcopy(rep.checks) == rep.checks


def overheads(fixed_b1=1.3, fixed_b8=1.5) -> list[dict]:
    """A bench-engine document's speculation_overheads (two contexts, batch buckets 1..8)."""
    rows = []
    for ctx in (32, 126):
        for b, fixed in ((1, fixed_b1), (2, 1.4), (4, 1.45), (8, fixed_b8)):
            rows.append({"context": ctx, "batch": b, "ar_ms": 1.0, "width1_ms": fixed, "fixed": fixed,
                         "per_node_ms": 0.01, "per_node": 0.01})
    return rows


def test_fixed_cost_is_gated_at_batch_1():
    base = {**make_doc(), "speculation_overheads": overheads()}
    rep = evaluate(base, make_doc(), GateConfig(), {"speculation_overheads": overheads(1.35, 1.55)})
    assert rep.passed, rep.text()
    fixed = [c for c in rep.checks if c.rule == "fixed_cost"]
    assert [c.point for c in fixed] == ["context 32 batch 1"]
    rep = evaluate(base, make_doc(), GateConfig(fixed_cost_margin=0.2), {"speculation_overheads": overheads(1.7)})
    bad = lines_for(rep, "fixed_cost", "FAIL")
    assert not rep.passed and len(bad) == 1 and "speculating got dearer" in bad[0] and "+30.8%" in bad[0]
    with pytest.raises(UserError, match="--engine-results"):
        evaluate(base, make_doc(), GateConfig())  # the baseline gates it: the engine document is required
    rep = evaluate(make_doc(), make_doc(), GateConfig(), {"speculation_overheads": overheads()})
    assert rep.passed and "fixed cost is not gated" in rep.text()  # an older baseline: a note, no check


def test_cli_engine_results_and_update_baseline_keep_the_overheads(tmp_path, capsys):
    base, res, eng = tmp_path / "base.json", tmp_path / "res.json", tmp_path / "engine.json"
    base.write_text(json.dumps(make_doc()))
    res.write_text(json.dumps(make_doc()))
    eng.write_text(json.dumps({"speculation_overheads": overheads()}))
    assert cli(["gate", "--baseline", str(base), "--results", str(res), "--engine-results", str(eng),
                "--update-baseline"]) == 0
    assert json.loads(base.read_text())["speculation_overheads_by_kernels"] == {"*": overheads()}
    eng.write_text(json.dumps({"speculation_overheads": overheads(1.7)}))
    assert cli(["gate", "--baseline", str(base), "--results", str(res), "--engine-results", str(eng)]) == 1
    assert "FAIL  fixed_cost" in capsys.readouterr().out
    assert cli(["gate", "--baseline", str(base), "--results", str(res)]) == 2  # gated, but no engine document
    eng.write_text(json.dumps({"rows": []}))
    assert cli(["gate", "--baseline", str(base), "--results", str(res), "--engine-results", str(eng)]) == 2


def test_fixed_cost_is_held_to_the_baseline_of_the_engines_own_kernels():
    """A CPU without AVX-512 runs torch's ops, whose fixed cost is its own: each kernel set has its baseline, and an
    engine whose kernel set the baseline lacks is not gated (a note), never held to another set's."""
    base = {**make_doc(), "speculation_overheads_by_kernels": {"cpu": overheads(1.3), "torch": overheads(1.8)}}
    ok_torch = evaluate(base, make_doc(), GateConfig(), {"kernels": "torch", "speculation_overheads": overheads(1.9)})
    assert ok_torch.passed and [c.point for c in ok_torch.checks if c.rule == "fixed_cost"] == \
        ["context 32 batch 1 (torch kernels)"]
    bad_torch = evaluate(base, make_doc(), GateConfig(), {"kernels": "torch", "speculation_overheads": overheads(2.4)})
    assert not bad_torch.passed and lines_for(bad_torch, "fixed_cost", "FAIL")
    bad_cpu = evaluate(base, make_doc(), GateConfig(), {"kernels": "cpu", "speculation_overheads": overheads(1.8)})
    assert not bad_cpu.passed and "+38.5%" in lines_for(bad_cpu, "fixed_cost", "FAIL")[0]
    only_cpu = {**make_doc(), "speculation_overheads_by_kernels": {"cpu": overheads(1.3)}}
    rep = evaluate(only_cpu, make_doc(), GateConfig(), {"kernels": "torch", "speculation_overheads": overheads(1.8)})
    assert rep.passed and not [c for c in rep.checks if c.rule == "fixed_cost"]
    assert "with this engine's kernels ('torch'; it has 'cpu')" in rep.text()


def test_update_baseline_keeps_the_other_kernel_sets_overheads(tmp_path):
    base, res, eng = tmp_path / "base.json", tmp_path / "res.json", tmp_path / "engine.json"
    base.write_text(json.dumps({**make_doc(), "speculation_overheads_by_kernels": {"cpu": overheads(1.3)}}))
    res.write_text(json.dumps(make_doc()))
    eng.write_text(json.dumps({"kernels": "torch", "speculation_overheads": overheads(1.8)}))
    assert cli(["gate", "--baseline", str(base), "--results", str(res), "--engine-results", str(eng),
                "--update-baseline"]) == 0
    assert json.loads(base.read_text())["speculation_overheads_by_kernels"] == {"cpu": overheads(1.3),
                                                                               "torch": overheads(1.8)}
    eng.write_text(json.dumps({"kernels": "cpu", "speculation_overheads": overheads(1.2)}))
    assert cli(["gate", "--baseline", str(base), "--results", str(res), "--engine-results", str(eng),
                "--update-baseline"]) == 0  # the cpu set's refreshed, the torch set's kept
    assert json.loads(base.read_text())["speculation_overheads_by_kernels"] == {"cpu": overheads(1.2),
                                                                               "torch": overheads(1.8)}
