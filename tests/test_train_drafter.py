"""train-drafter (self-distillation of an Apple-format drafter) and the committed models/small pair."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from trt_redrafter.cli import main as cli

REPO = Path(__file__).resolve().parents[1]
SMALL = REPO / "models" / "small"
# fast settings: a handful of short base-generated sequences, a few optimizer steps
FAST = ["--steps", "12", "--num-sequences", "8", "--eval-sequences", "4", "--seq-len", "12", "--batch-size", "64",
        "--gen-batch-size", "8", "--prompt-min", "8", "--prompt-max", "16", "--lr", "3e-3", "--device", "cpu",
        "--threads", "1"]


def _train(base: Path, out: Path, *extra) -> dict:
    rc = cli(["train-drafter", "--base-model", str(base), "--output", str(out), *FAST, *map(str, extra)])
    assert rc == 0
    return json.loads((out / "training.json").read_text())


@pytest.fixture(scope="module")
def trained(make_tiny_pair, tmp_path_factory):
    base = make_tiny_pair() / "base"
    out = tmp_path_factory.mktemp("drafter") / "d"
    return base, out, _train(base, out)


def test_training_lowers_the_loss_on_a_fixed_batch(trained):
    _, _, s = trained
    assert s["probe_loss_end"] < s["probe_loss_start"] - 0.1, s
    assert len(s["held_out"]["top1"]) == 4 and s["data"]["train_positions"] > 0


def test_writes_an_apple_drafter_the_converter_accepts(trained, tmp_path):
    base, out, _ = trained
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "recurrent_drafting_drafter" and cfg["rnn"] is True and cfg["num_draft_layers"] == 1
    names = set(load_file(str(out / "model.safetensors")))
    assert names == {"lm_head.0.linear.weight", "lm_head.0.linear.bias", "lm_head.1.weight", "rnn_u.weight",
                     "rnn_u.bias", "rnn_w.weight"}
    assert cli(["convert", "--base-model", str(base), "--drafter", str(out), "--output", str(tmp_path / "ck"),
                "--tp", "1", "--dtype", "float32", "--num-beams", "2", "--draft-len-per-beam", "4"]) == 0


def test_same_seed_same_bytes_and_options_shape_the_drafter(trained, tmp_path):
    base, out, _ = trained
    again = tmp_path / "again"
    _train(base, again)
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    other = tmp_path / "proj"
    _train(base, other, "--no-rnn", "--exit-dim", "96", "--num-layers", "2", "--draft-len", "2")
    cfg = json.loads((other / "config.json").read_text())
    assert (cfg["rnn"], cfg["exit_dim"], cfg["num_draft_layers"]) == (False, 96, 2)
    names = set(load_file(str(other / "model.safetensors")))
    assert "input_proj.weight" in names and not any(n.startswith("rnn_") for n in names)


def test_refusals(make_tiny_pair, tmp_path, capsys):
    base = make_tiny_pair() / "base"
    assert cli(["train-drafter", "--base-model", str(tmp_path / "nope"), "--output", str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "exists").mkdir()
    assert cli(["train-drafter", "--base-model", str(base), "--output", str(tmp_path / "exists")]) == 2
    assert "--force" in capsys.readouterr().err
    assert cli(["train-drafter", "--base-model", str(base), "--output", str(tmp_path / "o"), "--steps", "0"]) == 2


HELD_OUT_PROMPT = '''def dedent(text):
    """Remove any common leading whitespace from every line in `text`.
'''


@pytest.mark.skipif(not (SMALL / "drafter" / "model.safetensors").is_file(), reason="models/small not trained")
def test_committed_small_pair_accepts_drafts_and_matches_ar(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trt_redrafter.config import SamplingConfig
    from trt_redrafter.runtime.distributed import Dist
    from trt_redrafter.config import RuntimeConfig
    from trt_redrafter.runtime.engine import Engine
    from trt_redrafter.runtime.generate import generate

    AutoModelForCausalLM.from_pretrained(str(SMALL / "base"))  # loads with plain transformers
    ck, en = tmp_path / "ck", tmp_path / "en"
    assert cli(["convert", "--base-model", str(SMALL / "base"), "--drafter", str(SMALL / "drafter"), "--output",
                str(ck), "--tp", "1", "--dtype", "float32", "--num-beams", "4", "--draft-len-per-beam", "4"]) == 0
    assert cli(["build-engine", "--checkpoint", str(ck), "--output", str(en), "--tokenizer", str(SMALL / "base"),
                "--max-batch-size", "2", "--max-input-len", "128", "--max-seq-len", "256"]) == 0
    prompt = AutoTokenizer.from_pretrained(str(SMALL / "base"))(HELD_OUT_PROMPT)["input_ids"]
    engine = Engine(en, Dist(0, 1, torch.device("cpu")), RuntimeConfig(device="cpu", compile="off"))
    params = SamplingConfig(max_tokens=64)
    (rd,) = generate(engine, [prompt], params, mode="redrafter")
    (ar,) = generate(engine, [prompt], params, mode="ar")
    assert rd.output_ids == ar.output_ids
    assert rd.tokens_per_step > 1.5, rd.tokens_per_step
