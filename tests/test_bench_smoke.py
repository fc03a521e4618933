"""`trt-redrafter bench` end to end against a real tritonserver on a tiny engine (one QPS point, a few requests):
the JSON document, the markdown table and the PNG plots appear, with zero errors, for AR and each proposer. Plus
the per-request `decoding_mode` and `proposer` inputs the bench relies on."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine_utils import build_tiny_engines
from trt_redrafter.cli import main as cli
from trt_redrafter.errors import UserError
from trt_redrafter.serving.engine_model import parse_inputs


def _inputs(**kw):
    return {"input_ids": np.array([[5, 6, 7]], np.int32), "request_output_len": np.array([[4]], np.int32), **kw}


def test_decoding_mode_input():
    assert parse_inputs(_inputs()).spec.mode == "redrafter"
    assert parse_inputs(_inputs(decoding_mode=np.array([[b"ar"]], dtype=object))).spec.mode == "ar"
    assert parse_inputs(_inputs(decoding_mode=np.array([[b"ReDrafter"]], dtype=object))).spec.mode == "redrafter"
    with pytest.raises(UserError, match="decoding_mode must be one of"):
        parse_inputs(_inputs(decoding_mode=np.array([[b"medusa"]], dtype=object)))


def test_proposer_input():
    assert parse_inputs(_inputs()).spec.proposer is None  # the engine's default
    assert parse_inputs(_inputs(proposer=np.array([[b"NGram "]], dtype=object))).spec.proposer == "ngram"
    assert parse_inputs(_inputs(proposer=np.array([[b""]], dtype=object))).spec.proposer is None
    with pytest.raises(UserError, match="proposer must be one of"):
        parse_inputs(_inputs(proposer=np.array([[b"eagle"]], dtype=object)))
    with pytest.raises(UserError, match="one value per request"):
        parse_inputs(_inputs(proposer=np.array([[b"ngram", b"mixed"]], dtype=object)))


@pytest.mark.server
@pytest.mark.timeout(240)
def test_bench_end_to_end(tmp_path, capsys):
    pytest.importorskip("tritonclient.grpc", reason="tritonclient is not installed (pip install '.[serving]')")
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install '.[bench]')")
    from trt_redrafter.serving.launcher import find_tritonserver

    try:
        find_tritonserver()
    except UserError as e:
        pytest.skip(f"no tritonserver binary: {e}")
    _, engines = build_tiny_engines(tmp_path, seed=5, num_beams=2, draft_len=2, tps=(1,), max_batch_size=4)
    data = tmp_path / "prompts.jsonl"
    rows = [{"prompt": p} for p in ("The quick brown fox", "def main():", "Once upon a time", "a b c d")]
    rows.append({"prompt": "word " * 400})  # longer than max_input_len: dropped before the run, not an error
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "bench"
    rc = cli(["bench", "--engines", f"tp1={engines[1]}", "--dataset", str(data), "--qps", "8", "--num-requests", "4",
              "--warmup", "1", "--max-tokens", "12", "--repeats", "1", "--output", str(out), "--no-progress",
              "--compile", "off", "--speculate", "full", "--modes", "ar,redrafter,ngram,mixed"])
    assert rc == 0
    stdout = capsys.readouterr().out
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["errors"] == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["prompts"]["dropped_too_long"] == 1 and doc["git"]["sha"] and doc["machine"]["cpu_count"]
    assert doc["config"]["chat_template"] == "none"  # what was applied: auto leaves {"prompt"} rows raw
    assert {(p["tp"], p["mode"]) for p in doc["points"]} == {(1, m) for m in ("ar", "redrafter", "ngram", "mixed")}
    assert [s["mode"] for s in doc["speedups"]] == ["redrafter", "ngram", "mixed"]
    for p in doc["points"]:
        m = p["metrics"]
        assert m["errors"] == 0 and m["completed"] == 4
        assert m["output_tokens"] == 4 * 12 and m["tpot_ms"]["median"] > 0 and m["ttft_ms"]["p99"] > 0
    ar = next(p for p in doc["points"] if p["mode"] == "ar")["metrics"]
    rd = next(p for p in doc["points"] if p["mode"] == "redrafter")["metrics"]
    assert ar["tokens_per_step"] == 1.0 and ar["acceptance_rate"] is None  # AR really decoded AR
    assert rd["tokens_per_step"] >= 1.0 and rd["acceptance_rate"] is not None
    assert doc["speedups"][0]["speedup"] > 0
    assert "| 1 | 8 | redrafter |" in (out / "results.md").read_text() and "| TP | QPS | mode |" in stdout
    for png in ("ms_per_token.png", "speedup.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
