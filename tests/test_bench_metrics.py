"""The bench harness's arithmetic on synthetic timings with hand-computed answers (no server)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from trt_redrafter.bench.harness import BenchConfig, combine_repeats, point_order, Target
from trt_redrafter.bench.metrics import RequestRecord, distribution, median_of_points, percentile, summarize
from trt_redrafter.bench.schedule import (Prompt, first_prompts, load_prompts, pick_prompts, poisson_offsets,
                                         vicuna_prompt)
from trt_redrafter.errors import UserError


def rec(i, sent, times, tokens, **kw):
    return RequestRecord(i, sent, sent, list(times), list(tokens), **kw)


def test_tpot_itl_ttft_e2e_of_one_request():
    # first token at 100 ms, then three responses carrying 4, 3, 2 tokens: 10 tokens in all
    r = rec(0, 0.0, [0.100, 0.150, 0.230, 0.280], [1, 4, 3, 2])
    assert r.output_tokens == 10 and r.steps == 3
    assert r.ttft_s == pytest.approx(0.100) and r.e2e_s == pytest.approx(0.280)
    assert r.tpot_s == pytest.approx((0.280 - 0.100) / 9)  # (E2E - TTFT) / (n - 1), vLLM's TPOT
    assert r.itls_s == pytest.approx([0.050, 0.080, 0.050])  # gaps between responses, not per token
    assert rec(0, 0, [0.1], [1]).tpot_s is None  # one token: no TPOT
    assert rec(0, 0, [0.1, 0.2], [1, 1], error="boom").tpot_s is None


@pytest.mark.parametrize("q", [0, 10, 50, 90, 99, 100])
def test_percentile_matches_numpy_linear(q):
    xs = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6, 5.0]
    assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert percentile([], q) is None


def test_distribution_known_values():
    d = distribution([0.001, 0.002, 0.003, 0.004], 1e3)  # seconds -> ms
    assert d["mean"] == pytest.approx(2.5) and d["median"] == pytest.approx(2.5)
    assert d["p90"] == pytest.approx(3.7) and d["p99"] == pytest.approx(3.97) and d["n"] == 4


def test_summarize_point():
    recs = [
        rec(0, 0.0, [0.5, 0.6], [1, 1], warmup=True),  # excluded
        rec(1, 1.0, [0.1, 0.2, 0.3], [1, 2, 2]),  # 5 tokens, TPOT 50 ms, ends at 1.3 s
        rec(2, 2.0, [0.2, 0.4, 0.6], [1, 3, 1]),  # 5 tokens, TPOT 100 ms, ends at 2.6 s
        rec(3, 2.5, [], [], error="refused"),
    ]
    recs[1].accepted_draft_tokens, recs[1].draft_tokens = 2, 8
    recs[2].accepted_draft_tokens, recs[2].draft_tokens = 2, 8
    m = summarize(recs)
    assert m["completed"] == 2 and m["errors"] == 1 and m["error_samples"] == ["refused"]
    assert m["duration_s"] == pytest.approx(1.6)  # first measured send (1.0) to last completion (2.6)
    assert m["request_throughput"] == pytest.approx(2 / 1.6) and m["output_throughput"] == pytest.approx(10 / 1.6)
    assert m["tpot_ms"]["median"] == pytest.approx(75.0) and m["tpot_ms"]["p99"] == pytest.approx(99.5)
    assert m["ttft_ms"]["mean"] == pytest.approx(150.0)
    assert m["e2e_ms"]["median"] == pytest.approx(450.0)
    assert m["itl_ms"]["n"] == 4 and m["itl_ms"]["median"] == pytest.approx(150.0)  # [100, 100, 200, 200]
    assert m["tokens_per_step"] == pytest.approx((4 + 4) / 4)  # tokens after the first / generation steps
    assert m["acceptance_rate"] == pytest.approx(4 / 16)


def test_summarize_all_failed_has_no_throughput():
    m = summarize([rec(0, 0.0, [], [], error="x")])
    assert m["errors"] == 1 and m["request_throughput"] is None and m["tpot_ms"]["median"] is None


def test_median_over_repeats_and_speedup_within_repeats():
    def run(r, mode, tpot, errors=0):
        return {"repeat": r, "qps": 1.0, "tp": 1, "mode": mode,
                "metrics": {"tpot_ms": {"median": tpot}, "errors": errors, "error_samples": [], "tokens_per_step": 1.0}}

    runs = [run(0, "ar", 10.0), run(0, "redrafter", 5.0), run(1, "ar", 20.0), run(1, "redrafter", 8.0, errors=1),
            run(2, "ar", 12.0), run(2, "redrafter", 4.0)]
    out = combine_repeats(runs)
    ar = next(p for p in out["points"] if p["mode"] == "ar")
    assert ar["metrics"]["tpot_ms"]["median"] == 12.0 and ar["repeats"] == 3
    rd = next(p for p in out["points"] if p["mode"] == "redrafter")
    assert rd["metrics"]["errors"] == 1  # counts are summed, not medianed
    (s,) = out["speedups"]
    assert s["per_repeat"] == pytest.approx([2.0, 2.5, 3.0]) and s["speedup"] == pytest.approx(2.5)
    assert (s["min"], s["max"]) == pytest.approx((2.0, 3.0))
    assert median_of_points([{"a": None}, {"a": 2.0}])["a"] == 2.0


def test_poisson_schedule_mean_and_seed_determinism():
    a = poisson_offsets(20000, 4.0, seed=3)
    assert a[0] == 0.0 and all(y >= x for x, y in zip(a, a[1:]))
    gaps = np.diff(a)
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)  # mean gap 1/qps
    assert gaps.std() == pytest.approx(0.25, rel=0.05)  # exponential: std == mean
    assert poisson_offsets(50, 4.0, seed=3) == a[:50]
    assert poisson_offsets(50, 4.0, seed=4) != a[:50]
    assert poisson_offsets(3, math.inf, seed=0) == [0.0, 0.0, 0.0]
    with pytest.raises(UserError, match="QPS must be positive"):
        poisson_offsets(3, 0.0, seed=0)


def test_prompts_mt_bench_and_prompt_rows(tmp_path):
    f = tmp_path / "q.jsonl"
    f.write_text('{"question_id": 81, "category": "writing", "turns": ["Hi there", "second turn"]}\n\n'
                 '{"prompt": "def f():"}\n')
    # no tokenizer known: Vicuna v1.1 (a tokenizer's own template: tests/test_chat_template.py)
    assert load_prompts(f) == [Prompt(vicuna_prompt("Hi there"), "vicuna"), Prompt("def f():")]
    assert vicuna_prompt("Q").startswith("A chat between a curious user") and vicuna_prompt("Q").endswith(
        "USER: Q ASSISTANT:")
    assert load_prompts(f, "none") == [Prompt("Hi there"), Prompt("def f():")]
    assert load_prompts(f, "vicuna")[1] == Prompt(vicuna_prompt("def f():"), "vicuna")
    picked = pick_prompts(["a", "b", "c"], 7, seed=1)
    assert picked == pick_prompts(["a", "b", "c"], 7, seed=1) and sorted(set(picked)) == ["a", "b", "c"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    with pytest.raises(UserError, match="bad.jsonl:1 has neither"):
        load_prompts(bad)


def test_prompts_may_carry_a_schema_which_goes_to_the_server_as_a_guide(tmp_path):
    from trt_redrafter.bench.structured import TASKS
    from trt_redrafter.serving.client import GenerationRequest, build_inputs

    f = tmp_path / "q.jsonl"
    f.write_text('{"prompt": "a", "schema": {"type": "object"}}\n{"prompt": "b"}\n')
    assert [p.schema for p in load_prompts(f)] == ['{"type": "object"}', None]
    tasks = load_prompts("structured", "none")
    assert [(p.text, json.loads(p.schema)) for p in tasks] == [(t["prompt"], t["schema"]) for t in TASKS]
    f.write_text('{"prompt": "a", "schema": "object"}\n')
    with pytest.raises(UserError, match="'schema' must be a JSON schema"):
        load_prompts(f)
    names = [t.name() for t in build_inputs(GenerationRequest(prompt="a", max_tokens=4, guide_type="json_schema",
                                                              guide=tasks[0].schema))]
    assert {"guided_decoding_guide_type", "guided_decoding_guide"} <= set(names)


def test_first_prompts_spread_over_categories_or_in_file_order(tmp_path):
    """bench-engine's default prompts: one of each category before a second of any (MT-Bench's first rows are all
    one category); rows without a category come after; `file` keeps the file's order."""
    f = tmp_path / "q.jsonl"
    rows = [("a", "w1"), ("a", "w2"), ("a", "w3"), ("b", "m1"), (None, "raw"), ("c", "c1"), ("b", "m2")]
    f.write_text("".join(json.dumps({"category": c, "turns": [t]} if c else {"prompt": t}) + "\n" for c, t in rows))
    prompts = load_prompts(f, "none")
    assert [p.category for p in prompts] == ["a", "a", "a", "b", "", "c", "b"]
    texts = lambda ps: [p.text for p in ps]  # noqa: E731
    assert texts(first_prompts(prompts, 99)) == ["w1", "m1", "c1", "w2", "m2", "w3", "raw"]
    assert texts(first_prompts(prompts, 3)) == ["w1", "m1", "c1"]
    assert texts(first_prompts(prompts, 3, "file")) == ["w1", "w2", "w3"]
    assert first_prompts([Prompt("x"), Prompt("y")], 1) == [Prompt("x")]  # no categories: the file's order
    with pytest.raises(UserError, match="--prompt-order must be one of categories, file"):
        first_prompts(prompts, 3, "random")


def test_bench_config_validation_names_the_field():
    assert BenchConfig(qps="0.5, 1,2").qps_list() == [0.5, 1.0, 2.0]
    with pytest.raises(UserError, match="bench.qps"):
        BenchConfig.from_dict({"qps": "fast"})
    with pytest.raises(UserError, match="bench.modes"):
        BenchConfig.from_dict({"modes": "ar,medusa"})


def test_point_order_interleaves_and_flips_modes():
    ts = [Target(tp, m, "u", m) for tp in (2, 1) for m in ("redrafter", "ar")]
    assert [(t.tp, t.mode) for t in point_order(ts, 0)] == [(1, "ar"), (1, "redrafter"), (2, "ar"), (2, "redrafter")]
    assert [(t.tp, t.mode) for t in point_order(ts, 1)] == [(1, "redrafter"), (1, "ar"), (2, "redrafter"), (2, "ar")]


def test_drafter_scaling_summary_means_pools_and_counts_cut_answers():
    """scripts/drafter_scaling.py's per-tree figures from `run --json` rows: the mean of the prompts' tokens/step,
    the pooled one (all tokens over all steps), the answers --max-tokens cut, per category, and == AR."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    try:
        from drafter_scaling import summarize as summarize_tree
    finally:
        sys.path.pop(0)
    rows = [{"tokens_per_step": 2.0, "steps": 10, "output_ids": list(range(21)), "finish_reason": "stop"},
            {"tokens_per_step": 1.0, "steps": 30, "output_ids": list(range(31)), "finish_reason": "length"},
            {"tokens_per_step": 3.0, "steps": 20, "output_ids": list(range(61)), "finish_reason": "stop"}]
    s = summarize_tree(rows, ["math", "math", "coding"], [r["output_ids"] for r in rows])
    assert s["tokens_per_step"] == 2.0  # (2 + 1 + 3) / 3
    assert s["pooled_tokens_per_step"] == round((20 + 30 + 60) / 60, 3)  # long answers weigh more
    assert s["answers_cut_at_max_tokens"] == 1
    assert s["output_tokens"] == [21, 31, 61]
    assert s["by_category"] == {"math": 1.5, "coding": 3.0}
    assert s["identical_to_ar"] is True
    assert summarize_tree(rows, ["a", "b", "c"], [[0], [1], [2]])["identical_to_ar"] is False
