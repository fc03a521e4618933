"""The generated tables of docs/*.md against the committed JSON they are rendered from (scripts/render_docs.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trt_redrafter.bench.docs_tables import TABLES, render_doc, stale_docs
from trt_redrafter.errors import UserError

ROOT = Path(__file__).resolve().parents[1]


def test_committed_docs_match_their_json():
    assert stale_docs(ROOT) == [], "run python scripts/render_docs.py and commit the docs it rewrites"


def test_check_exits_1_when_a_table_drifts_from_its_json(tmp_path):
    """A figure edited by hand in a table is caught; rendering puts the JSON's figure back."""
    for doc in {t.doc for t in TABLES.values()}:
        (tmp_path / doc).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / doc, tmp_path / doc)
    shutil.copytree(ROOT / "docs" / "perf", tmp_path / "docs" / "perf")
    script = [sys.executable, str(ROOT / "scripts" / "render_docs.py"), "--root", str(tmp_path)]
    assert subprocess.run(script + ["--check"], capture_output=True, timeout=60).returncode == 0

    calibration = json.loads((tmp_path / "docs/perf/calibration-smollm2.json").read_text())
    calibration["overall"][0]["nodes"] += 1  # a new measurement, its table not rendered again
    (tmp_path / "docs/perf/calibration-smollm2.json").write_text(json.dumps(calibration))
    check = subprocess.run(script + ["--check"], capture_output=True, text=True, timeout=60)
    assert check.returncode == 1 and "docs/perf.md" in check.stderr

    assert subprocess.run(script, capture_output=True, timeout=60).returncode == 0
    assert f"| {calibration['overall'][0]['nodes']} |" in (tmp_path / "docs/perf.md").read_text()
    assert subprocess.run(script + ["--check"], capture_output=True, timeout=60).returncode == 0


def test_unknown_or_missing_markers_are_refused():
    table = "<!-- table: no-such-table -->\n| a |\n<!-- /table -->\n"
    with pytest.raises(UserError, match="no-such-table"):
        render_doc("docs/other.md", table, ROOT)
    with pytest.raises(UserError, match="no markers for table"):
        render_doc("docs/perf.md", "no tables here\n", ROOT)
