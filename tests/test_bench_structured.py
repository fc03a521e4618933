"""`trt-redrafter bench-structured` (bench/structured.py): its tasks' schemas, its summary, and a run on a tiny engine
(llama.cpp's row needs a GGUF model; the command's run against SmolLM2 is in docs/perf.md)."""

from __future__ import annotations

import json

import jsonschema

from trt_redrafter.bench import structured as S
from trt_redrafter.cli import main as cli


def test_every_task_schema_is_valid_and_its_strings_bounded():
    assert len(S.TASKS) >= 10 and len({t["name"] for t in S.TASKS}) == len(S.TASKS)
    for t in S.TASKS:
        jsonschema.Draft202012Validator.check_schema(t["schema"])
        text = json.dumps(t["schema"])
        assert text.count('"type": "string"') == text.count('"maxLength"') + text.count('"enum"'), t["name"]


def test_the_summary_pairs_each_task_with_ar():
    run = S.Run
    runs = [run("a", "ar", 0, "{}", 11, 0.11, True, 10.0, steps=10), run("a", "redrafter", 0, "{}", 11, 0.055, True,
                                                                      5.0, steps=5),
            run("b", "ar", 0, "{}", 21, 0.21, True, 10.0, steps=20), run("b", "redrafter", 0, "[", 21, 0.07, False,
                                                                      10 / 3, steps=4)]
    ar, rd = S.summarize(runs)
    assert (ar.mode, ar.valid, ar.tokens_per_step) == ("ar", "2/2", 1.0)
    assert rd.valid == "1/2" and rd.same_text_as_ar == "1/2" and rd.tokens_per_step == 30 / 9
    assert rd.vs_ar == 2.5 and rd.vs_ar_quartiles[0] <= 2.5 <= rd.vs_ar_quartiles[1]  # per task: 2 and 3
    assert rd.vs_ar_end_to_end == 2.5  # wall time over tokens: 10 / 5 and 10 / 3.33
    assert "| redrafter | 1/2 |" in S.table([ar, rd])


def test_bench_structured_on_a_tiny_engine(tiny_pair, tmp_path, capsys):
    engine = tmp_path / "engine"
    assert cli(["build-engine", "--config", "builders/tiny.yaml", "--base-model", str(tiny_pair / "base"),
                "--drafter", str(tiny_pair / "drafter"), "--output", str(engine), "--tp", "1",
                "--max-input-len", "256", "--max-seq-len", "320"]) == 0  # the tasks' prompts in the tiny vocabulary
    out = tmp_path / "structured.json"
    assert cli(["bench-structured", "--engine", str(engine), "--tasks", "2", "--rounds", "1", "--max-tokens", "24",
                "--compile", "off", "--output", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert {s["mode"] for s in doc["summary"]} == {"ar", "redrafter"}
    rd = next(s for s in doc["summary"] if s["mode"] == "redrafter")
    assert rd["same_text_as_ar"] == "2/2" and rd["vs_ar"] > 0
    assert len(doc["runs"]) == 4 and all(r["tokens"] > 0 for r in doc["runs"])
    assert "| ar |" in capsys.readouterr().out
