"""Every input the user can get wrong is refused through the CLI with exit status 2, one `error: ...` sentence
naming the problem, and no output directory (nor `.tmp-` leftovers) afterwards.

Most cases call the CLI entry point in-process (`trt_redrafter.cli.main`, the console script's function) to keep
the suite fast; `test_real_subprocess` runs the installed console script / `python -m` for a few of them.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from trt_redrafter.cli import main as cli

RECIPES = Path(__file__).resolve().parents[1] / "builders"


def refused(capsys, tmp_path, argv: list, *needles: str, out: Path | None = None) -> str:
    """Run the CLI, expect exit 2 and a message containing every needle, and no output left behind."""
    out = out or tmp_path / "out"
    argv = [str(a) for a in argv] + (["--output", str(out)] if "--output" not in argv else [])
    try:
        rc = cli(argv)
    except SystemExit as e:  # argparse's own refusals
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "error:" in err
    for n in needles:
        assert n in err, f"{n!r} not in {err!r}"
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if ".tmp-" in p.name]
    return err


def conv(pair: Path, *extra, drafter: Path | None = None) -> list:
    return ["convert", "--base-model", pair / "base", "--drafter", drafter or pair / "drafter", *extra]


def copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_json(path: Path, **changes) -> None:
    d = json.loads(path.read_text())
    d.update(changes)
    path.write_text(json.dumps(d))


def drop_tensor(path: Path, *names: str) -> None:
    t = load_file(str(path))
    save_file({k: v for k, v in t.items() if k not in names}, str(path))


# ---- missing or unreadable inputs ------------------------------------------------------------------------------

def test_missing_base_dir(capsys, tmp_path, tiny_pair):
    refused(capsys, tmp_path, ["convert", "--base-model", tmp_path / "nope", "--drafter", tiny_pair / "drafter"],
            "nope", "does not exist")


def test_missing_config_json(capsys, tmp_path, tiny_pair):
    base = copy_dir(tiny_pair / "base", tmp_path / "base")
    (base / "config.json").unlink()
    refused(capsys, tmp_path, ["convert", "--base-model", base, "--drafter", tiny_pair / "drafter"], "config.json")


def test_missing_weights(capsys, tmp_path, tiny_pair):
    base = copy_dir(tiny_pair / "base", tmp_path / "base")
    (base / "model.safetensors").unlink()
    refused(capsys, tmp_path, ["convert", "--base-model", base, "--drafter", tiny_pair / "drafter"],
            "has no weights", "model.safetensors")


def test_corrupt_weights(capsys, tmp_path, tiny_pair):
    base = copy_dir(tiny_pair / "base", tmp_path / "base")
    (base / "model.safetensors").write_bytes(b"not a safetensors file")
    refused(capsys, tmp_path, ["convert", "--base-model", base, "--drafter", tiny_pair / "drafter"],
            "cannot read", "model.safetensors")


def test_missing_base_tensors(capsys, tmp_path, tiny_pair):
    base = copy_dir(tiny_pair / "base", tmp_path / "base")
    drop_tensor(base / "model.safetensors", "model.layers.1.mlp.up_proj.weight", "model.norm.weight")
    refused(capsys, tmp_path, ["convert", "--base-model", base, "--drafter", tiny_pair / "drafter"],
            "model.layers.1.mlp.up_proj.weight", "model.norm.weight")


def test_missing_drafter_tensor(capsys, tmp_path, tiny_pair):
    d = copy_dir(tiny_pair / "drafter", tmp_path / "drafter")
    drop_tensor(d / "model.safetensors", "lm_head.0.linear.bias")
    refused(capsys, tmp_path, conv(tiny_pair, drafter=d), "lm_head.0.linear.bias")


def test_missing_drafter_weights(capsys, tmp_path, tiny_pair):
    d = copy_dir(tiny_pair / "drafter", tmp_path / "drafter")
    (d / "model.safetensors").unlink()
    refused(capsys, tmp_path, conv(tiny_pair, drafter=d), "model.safetensors", "model.pt")


# ---- base / drafter disagreement -------------------------------------------------------------------------------

def test_hidden_size_mismatch(capsys, tmp_path, tiny_pair, make_tiny_pair):
    other = make_tiny_pair(hidden_size=32, intermediate_size=64)
    refused(capsys, tmp_path, conv(tiny_pair, drafter=other / "drafter"), "hidden_size=32", "hidden_size=64")


def test_vocab_mismatch(capsys, tmp_path, tiny_pair, make_tiny_pair):
    other = make_tiny_pair(vocab_size=390)
    refused(capsys, tmp_path, conv(tiny_pair, drafter=other / "drafter"), "vocab_size=390", "vocab_size=384")


def test_exit_dim_without_input_proj(capsys, tmp_path, tiny_pair):
    d = copy_dir(tiny_pair / "drafter", tmp_path / "drafter")
    edit_json(d / "config.json", exit_dim=96)
    refused(capsys, tmp_path, conv(tiny_pair, drafter=d), "exit_dim=96", "input_proj")


def test_input_proj_with_exit_dim_2h(capsys, tmp_path, tiny_pair, make_tiny_pair):
    d = copy_dir(make_tiny_pair(exit_dim=96) / "drafter", tmp_path / "drafter")
    edit_json(d / "config.json", exit_dim=128)
    refused(capsys, tmp_path, conv(tiny_pair, drafter=d), "input_proj", "exit_dim=128")


def test_rnn_true_without_rnn_tensors(capsys, tmp_path, tiny_pair):
    d = copy_dir(tiny_pair / "drafter", tmp_path / "drafter")
    drop_tensor(d / "model.safetensors", "rnn_u.weight", "rnn_u.bias", "rnn_w.weight")
    refused(capsys, tmp_path, conv(tiny_pair, drafter=d), "rnn=true", "rnn_u.weight")


def test_rnn_false_with_rnn_tensors(capsys, tmp_path, tiny_pair):
    d = copy_dir(tiny_pair / "drafter", tmp_path / "drafter")
    edit_json(d / "config.json", rnn=False)
    refused(capsys, tmp_path, conv(tiny_pair, drafter=d), "rnn=false", "rnn_u")


# ---- TP sizes TensorRT-LLM cannot shard ------------------------------------------------------------------------

@pytest.mark.parametrize("sizes,tp,needles", [
    ({}, 3, ("--tp 3", "num_attention_heads=4")),
    ({"intermediate_size": 126}, 4, ("intermediate_size=126",)),
    ({"hidden_size": 96, "num_heads": 12, "num_kv_heads": 6}, 4, ("num_key_value_heads=6", "duplicates")),
])
def test_tp_not_shardable(capsys, tmp_path, make_tiny_pair, sizes, tp, needles):
    refused(capsys, tmp_path, conv(make_tiny_pair(**sizes), "--tp", tp), *needles)


@pytest.mark.parametrize("sizes", [{"exit_dim": 98}, {"vocab_size": 390}])
def test_tp_not_dividing_the_drafter_replicates_it(tmp_path, make_tiny_pair, sizes):
    """Not a refusal: every rank holds the whole drafter (draft TP 1), flagged in config.json."""
    from safetensors.torch import load_file

    from trt_redrafter.checkpoint.trtllm_config import REPLICATED_KEY

    assert cli([str(a) for a in conv(make_tiny_pair(**sizes), "--tp", 4, "--output", tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())[REPLICATED_KEY] is True
    r0, r3 = (load_file(str(tmp_path / "out" / f"rank{r}.safetensors")) for r in (0, 3))
    drafter = [n for n in r0 if n.startswith("drafter.")]
    assert drafter and all(r0[n].equal(r3[n]) for n in drafter)


# ---- flags -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags,needles", [
    (["--num-beams", "0"], ("num_beams", "positive")),
    (["--draft-len-per-beam", "-1"], ("draft_len_per_beam", "positive")),
    (["--dtype", "float8"], ("dtype", "float8")),
    (["--trtllm-format", "2.x"], ("trtllm-format", "2.x")),
    (["--tp", "0"], ("--tp", "positive")),
])
def test_bad_flags(capsys, tmp_path, tiny_pair, flags, needles):
    refused(capsys, tmp_path, conv(tiny_pair, *flags), *needles)


def test_recipe_model_mismatch(capsys, tmp_path, tiny_pair):
    refused(capsys, tmp_path, conv(tiny_pair, "--config", RECIPES / "vicuna-7b.yaml"), "vocab_size=384", "32000",
            "vicuna-7b.yaml")


def test_existing_output_without_force(capsys, tmp_path, tiny_pair):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("x")
    try:
        rc = cli([str(a) for a in conv(tiny_pair, "--output", out)])
    finally:
        err = capsys.readouterr().err
    assert rc == 2 and "already exists" in err and "--force" in err
    assert [p.name for p in out.iterdir()] == ["keep"]


# ---- two-step form ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def base_ckpt(tiny_pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("two-step") / "base-tp2"
    assert cli(["convert", "--base-model", str(tiny_pair / "base"), "--base-only", "--output", str(out),
                "--tp", "2", "--dtype", "float16"]) == 0
    return out


def test_two_step_tp_mismatch(capsys, tmp_path, tiny_pair, base_ckpt):
    refused(capsys, tmp_path, ["convert", "--base-checkpoint", base_ckpt, "--drafter", tiny_pair / "drafter",
                               "--tp", "4"], "--tp 4", "tp_size=2")


def test_two_step_dtype_mismatch(capsys, tmp_path, tiny_pair, base_ckpt):
    refused(capsys, tmp_path, ["convert", "--base-checkpoint", base_ckpt, "--drafter", tiny_pair / "drafter",
                               "--dtype", "bfloat16"], "bfloat16", "float16")


def test_two_step_missing_rank_file(capsys, tmp_path, tiny_pair, base_ckpt):
    base = copy_dir(base_ckpt, tmp_path / "base")
    (base / "rank1.safetensors").unlink()
    refused(capsys, tmp_path, ["convert", "--base-checkpoint", base, "--drafter", tiny_pair / "drafter"],
            "rank1.safetensors")


# ---- the installed entry points ----------------------------------------------------------------------------------

def test_real_subprocess(tmp_path, tiny_pair):
    """The console script and `python -m trt_redrafter` map a refusal to exit 2 and `error: ...` on stderr."""
    runs = {
        "tp": [shutil.which("trt-redrafter") or "trt-redrafter", *map(str, conv(tiny_pair, "--tp", "3")),
               "--output", str(tmp_path / "a")],
        "missing": [sys.executable, "-m", "trt_redrafter", "convert", "--base-model", str(tmp_path / "nope"),
                    "--drafter", str(tiny_pair / "drafter"), "--output", str(tmp_path / "b")],
    }
    procs = {k: subprocess.Popen(v, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for k, v in runs.items()}
    errs = {}
    for k, p in procs.items():
        _, errs[k] = p.communicate(timeout=120)
        assert p.returncode == 2, (k, errs[k])
        assert errs[k].strip().splitlines()[-1].startswith("error: "), errs[k]
    assert "num_attention_heads=4" in errs["tp"] and "does not exist" in errs["missing"]
    assert sorted(p.name for p in tmp_path.iterdir()) == []
