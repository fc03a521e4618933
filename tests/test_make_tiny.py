"""make-tiny: deterministic bytes, loadable by transformers, and a drafter that matches its base."""

from __future__ import annotations

import json

import pytest
import torch

from trt_redrafter.checkpoint.drafter import read_drafter
from trt_redrafter.checkpoint.hf import read_hf_model
from trt_redrafter.cli import main as cli


def test_deterministic_by_seed(tiny_pair, tmp_path):
    assert cli(["make-tiny", "--output", str(tmp_path / "same")]) == 0
    assert cli(["make-tiny", "--output", str(tmp_path / "other"), "--seed", "1"]) == 0
    for f in ("base/model.safetensors", "drafter/model.safetensors", "base/tokenizer.json"):
        assert (tmp_path / "same" / f).read_bytes() == (tiny_pair / f).read_bytes(), f
    for f in ("base/model.safetensors", "drafter/model.safetensors"):
        assert (tmp_path / "other" / f).read_bytes() != (tiny_pair / f).read_bytes(), f


def test_the_bytes_do_not_depend_on_what_the_process_imported_before(tiny_pair, tmp_path):
    """A package holds a submodule as an attribute once anything imported it; the tokenizer's training text must not
    change with that (it did: the fast tier under pytest-xdist made another tokenizer in another test order)."""
    import subprocess
    import sys

    code = ("import json.tool, unittest.mock, logging.handlers, email.mime.text, sys; "
            "from trt_redrafter.cli import main; sys.exit(main(['make-tiny', '--output', sys.argv[1]]))")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "after")], check=True, capture_output=True)
    for f in ("base/tokenizer.json", "base/model.safetensors", "drafter/model.safetensors"):
        assert (tmp_path / "after" / f).read_bytes() == (tiny_pair / f).read_bytes(), f


def test_transformers_loads_it(tiny_pair):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_pair / "base")
    model = AutoModelForCausalLM.from_pretrained(tiny_pair / "base")
    assert len(tok) == model.config.vocab_size == 384
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2, 3)
    assert model.config.bos_token_id == 1 and model.config.eos_token_id == 2
    ids = tok("def convert(x): return x").input_ids
    assert ids[0] == 1 and tok.decode(ids[1:]) == "def convert(x): return x"
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]  # [T, V]
    assert logits.std(dim=-1).min() > 0.3  # random but not flat
    assert model.dtype == torch.float32


def test_drafter_matches_base_and_is_not_degenerate(tiny_pair):
    cfg = json.loads((tiny_pair / "drafter" / "config.json").read_text())
    assert cfg["model_type"] == "recurrent_drafting_drafter" and cfg["num_lookback_tokens"] == -1
    d, base = read_drafter(tiny_pair / "drafter"), read_hf_model(tiny_pair / "base")
    assert (d.config.vocab_size, d.config.hidden_size, d.config.exit_dim) == (384, 64, 128)
    assert d.config.rnn and d.config.num_draft_layers == 1
    # logits of the drafter head on a unit-scale input are spread out (std well above 1)
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(0))
    h = x + torch.nn.functional.silu(x @ d.tensors["lm_head.0.linear.weight"].T + d.tensors["lm_head.0.linear.bias"])
    assert (h @ d.tensors["lm_head.1.weight"].T).std(dim=-1).min() > 1.0
    assert base.config.vocab_size == d.config.vocab_size and base.config.hidden_size == d.config.hidden_size


def test_cli_sizes_and_flags(tmp_path):
    out = tmp_path / "t"
    assert cli(["make-tiny", "--output", str(out), "--vocab-size", "300", "--hidden-size", "32", "--num-heads", "2",
                "--num-kv-heads", "1", "--intermediate-size", "48", "--num-layers", "1", "--drafter-layers", "2",
                "--exit-dim", "40", "--no-rnn", "--tie-word-embeddings"]) == 0
    base, d = read_hf_model(out / "base"), read_drafter(out / "drafter")
    c = base.config
    assert (c.vocab_size, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size,
            c.num_hidden_layers, c.tie_word_embeddings) == (300, 32, 2, 1, 48, 1, True)
    assert "lm_head.weight" not in base.names() and base.tied
    assert (d.config.exit_dim, d.config.num_draft_layers, d.config.rnn) == (40, 2, False)
    assert "input_proj.weight" in d.tensors and "rnn_u.weight" not in d.tensors


@pytest.mark.parametrize("flags,needle", [
    (["--vocab-size", "100"], "vocab_size"),
    (["--num-heads", "3"], "num_heads=3"),
])
def test_refusals(tmp_path, capsys, flags, needle):
    assert cli(["make-tiny", "--output", str(tmp_path / "t"), *flags]) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "t").exists()
    existing = tmp_path / "exists"
    existing.mkdir()
    assert cli(["make-tiny", "--output", str(existing)]) == 2
    assert "already exists" in capsys.readouterr().err
