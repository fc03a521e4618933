"""scripts/gpu_bench.py's rate-oracle mode (trt_redrafter/bench/oracle.py's ContinuationOracle at a set acceptance),
on the tiny shape on the CPU: the numbers it reports on a GPU are only meaningful if its model keeps greedy ReDrafter
== AR (the successor weights) and its oracle delivers the acceptance it was set to."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trt_redrafter.bench.oracle import per_token_acceptance

ROOT = Path(__file__).resolve().parents[1]


def test_per_token_acceptance_inverts_the_tree_mean():
    for target, dl in ((3.5, 4), (1.6, 4), (2.0, 2)):
        p = per_token_acceptance(target, dl)
        assert sum(p ** j for j in range(dl + 1)) == pytest.approx(target, rel=1e-9)


def test_rate_oracle_run_keeps_greedy_equal_and_its_rate(tmp_path):
    out = tmp_path / "oracle.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "gpu_bench.py"), "--shape", "tiny", "--device", "cpu",
           "--compile", "off", "--batches", "1,4", "--prompt-len", "16", "--max-tokens", "96", "--repeats", "1",
           "--oracle-tokens-per-step", "3.5", "--output", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "crossover" in proc.stdout
    doc = json.loads(out.read_text())
    assert [r["batch"] for r in doc["runs"]] == [1, 4]
    for r in doc["runs"]:
        for mode in ("full", "auto"):
            assert r[mode]["equals_ar"] == r["batch"], (mode, r)
        # every tree verified whole: the oracle's designed 3.5 tokens/step (96 tokens, so a loose band)
        assert 2.8 < r["full"]["tokens_per_step"] < 4.2, r
        assert r["full"]["widths"] == {"25": r["full"]["widths"]["25"]}
