"""End-to-end conversion of make-tiny pairs: every full weight rebuilt from the rank files by TensorRT-LLM's rules
must equal the HF / Apple weight exactly, and config.json must carry what TensorRT-LLM's converter writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from trt_redrafter.checkpoint import sharding
from trt_redrafter.checkpoint.convert import (ConvertConfig, convert_base_checkpoint, convert_checkpoint,
                                              read_rank_files, unshard_checkpoint)
from trt_redrafter.checkpoint.trtllm_config import REDRAFTER_KEYS, parse_checkpoint_config
from trt_redrafter.cli import main as cli
from trt_redrafter.config import ReDrafterConfig

RECIPES = Path(__file__).resolve().parents[1] / "builders"
RD = ReDrafterConfig(num_beams=3, draft_len_per_beam=2, greedy_search=False)


def hf_weights(pair):
    return load_file(str(pair / "base" / "model.safetensors"))


def drafter_weights(pair):
    return load_file(str(pair / "drafter" / "model.safetensors"))


def convert(pair, out, tp, fmt="1.x", dtype="float32", **kw):
    return convert_checkpoint(pair / "drafter", out, ConvertConfig(tp=tp, dtype=dtype, trtllm_format=fmt, workers=2),
                              RD, base_model=pair / "base", **kw)


def check_roundtrip(pair, ckpt, tp):
    """Rebuild from the rank files and compare with the inputs (torch.equal, fp32)."""
    info = parse_checkpoint_config(json.loads((ckpt / "config.json").read_text()), "test")
    assert info.tp_size == tp
    ranks = read_rank_files(ckpt, tp)
    for r in ranks:
        assert all(t.is_contiguous() and t.dtype == torch.float32 for t in r.values())
    base, drafter = unshard_checkpoint(ranks, info.model, info.drafter)
    hf = hf_weights(pair)
    if "lm_head.weight" not in hf:  # tied: lm_head is the embedding
        hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
    assert set(base) == set(hf)
    for name, t in hf.items():
        assert torch.equal(base[name], t), name
    apple = drafter_weights(pair)
    assert set(drafter) == set(apple)
    for name, t in apple.items():
        assert torch.equal(drafter[name], t), name
    # nothing but the tables' tensors is written
    names = {n for n, _, _ in sharding.base_name_table(info.model)}
    names |= {f"transformer.layers.{i}.{t}" for i in range(info.model.num_hidden_layers)
              for t, _ in sharding.qkv_table(info.model)}
    names |= {"lm_head.weight"} | {n for n, _ in sharding.drafter_name_table(info.drafter)}
    assert all(set(r) == names for r in ranks)
    return info, ranks


@pytest.mark.parametrize("fmt", ["1.x", "legacy"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_roundtrip_and_config(tiny_pair, tmp_path, tp, fmt):
    ckpt = convert(tiny_pair, tmp_path / "ckpt", tp, fmt)
    info, ranks = check_roundtrip(tiny_pair, ckpt, tp)
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["architecture"] == {"1.x": "ReDrafterForLLaMALM", "legacy": "ReDrafterForCausalLM"}[fmt]
    assert cfg["base_model_architecture"] == "LlamaForCausalLM"
    assert list(cfg)[-8:] == ["base_model_architecture", *REDRAFTER_KEYS]
    assert {k: cfg[k] for k in REDRAFTER_KEYS} == {
        "redrafter_num_layers": 1, "redrafter_hidden_size": 64, "redrafter_exit_dim": 128, "redrafter_is_rnn": True,
        "redrafter_num_beams": 3, "redrafter_draft_len_per_beam": 2, "redrafter_greedy_search": False}
    assert cfg["mapping"]["tp_size"] == cfg["mapping"]["world_size"] == tp
    assert cfg["dtype"] == "float32" and cfg["vocab_size"] == 384 and cfg["num_key_value_heads"] == 2
    # per-rank shapes from reference §2.3 (H=64, I=128, V=384, 4 heads of 16, 2 kv heads, exit_dim 128)
    kv_rows = max(2 // tp, 1) * 16
    r0 = ranks[0]
    assert r0["transformer.layers.0.attention.qkv.weight"].shape == (64 // tp + 2 * kv_rows, 64)
    assert r0["transformer.layers.0.attention.dense.weight"].shape == (64, 64 // tp)
    assert r0["transformer.layers.0.mlp.proj.weight"].shape == (64, 128 // tp)
    assert r0["lm_head.weight"].shape == (384 // tp, 64)
    assert r0["transformer.vocab_embedding.weight"].shape == (384, 64)
    assert r0["drafter.lm_head.weight"].shape == (384 // tp, 128)
    assert r0["drafter.rnn_w.weight"].shape == (64 // tp, 64)


def test_safetensors_have_no_metadata_like_trtllm(tiny_pair, tmp_path):
    ckpt = convert(tiny_pair, tmp_path / "ckpt", 2)
    with safe_open(str(ckpt / "rank0.safetensors"), "pt") as f:
        assert f.metadata() is None
    assert not (ckpt / "config.json").read_text().endswith("\n")


@pytest.mark.parametrize("nkv", [1, 2])
def test_gqa_kv_duplication_tp4(make_tiny_pair, tmp_path, nkv):
    pair = make_tiny_pair(num_kv_heads=nkv)
    ckpt = convert(pair, tmp_path / "ckpt", 4)
    _, ranks = check_roundtrip(pair, ckpt, 4)
    k = hf_weights(pair)["model.layers.1.self_attn.k_proj.weight"]  # [nkv*16, 64]
    for r in range(4):
        qkv = ranks[r]["transformer.layers.1.attention.qkv.weight"]  # [16 + 16 + 16, 64]
        head = r * nkv // 4  # TensorRT-LLM's dup_kv_weight: rank r holds kv head r*nkv//tp
        assert torch.equal(qkv[16:32], k[head * 16:(head + 1) * 16])


def test_input_proj_and_no_rnn(make_tiny_pair, tmp_path):
    pair = make_tiny_pair(exit_dim=96, rnn=False, drafter_layers=2)
    ckpt = convert(pair, tmp_path / "ckpt", 2)
    info, ranks = check_roundtrip(pair, ckpt, 2)
    assert info.drafter.exit_dim == 96 and not info.drafter.rnn
    assert ranks[1]["drafter.input_proj.weight"].shape == (48, 128)
    assert not any(n.startswith("drafter.rnn_") for n in ranks[0])


def test_tied_embeddings(make_tiny_pair, tmp_path):
    pair = make_tiny_pair(tie_word_embeddings=True)
    assert "lm_head.weight" not in hf_weights(pair)
    ckpt = convert(pair, tmp_path / "ckpt", 2)
    info, _ = check_roundtrip(pair, ckpt, 2)
    assert info.model.tie_word_embeddings
    assert json.loads((ckpt / "config.json").read_text())["tie_word_embeddings"] is True


@pytest.mark.parametrize("dtype,td", [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_dtype_casting(tiny_pair, tmp_path, dtype, td):
    ref = read_rank_files(convert(tiny_pair, tmp_path / "fp32", 2), 2)
    low = read_rank_files(convert(tiny_pair, tmp_path / dtype, 2, dtype=dtype), 2)
    assert json.loads((tmp_path / dtype / "config.json").read_text())["dtype"] == dtype
    for r in range(2):
        assert set(low[r]) == set(ref[r])
        for n, t in low[r].items():
            assert t.dtype == td and torch.equal(t, ref[r][n].to(td)), n


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_two_step_equals_one_step(make_tiny_pair, tmp_path, family):
    """A base checkpoint as TensorRT-LLM's Llama / Qwen converter writes it, then the drafter added (`--base-checkpoint`,
    examples/redrafter/convert_checkpoint.py): the same files as the one-step conversion."""
    tiny_pair = make_tiny_pair(family=family)
    base = convert_base_checkpoint(tiny_pair / "base", tmp_path / "base-ckpt", tp=2, dtype="float32")
    base_cfg = json.loads((base / "config.json").read_text())
    assert base_cfg["architecture"] == json.loads((tiny_pair / "base" / "config.json").read_text())["architectures"][0]
    assert not any(k in base_cfg for k in REDRAFTER_KEYS)
    two = convert_checkpoint(tiny_pair / "drafter", tmp_path / "two", ConvertConfig(), RD, base_checkpoint=base)
    one = convert(tiny_pair, tmp_path / "one", 2)
    assert (two / "config.json").read_bytes() == (one / "config.json").read_bytes()
    base_ranks = read_rank_files(base, 2)
    for r, (a, b) in enumerate(zip(read_rank_files(two, 2), read_rank_files(one, 2))):
        assert set(a) == set(b)
        assert all(torch.equal(a[n], b[n]) for n in a)
        assert all(torch.equal(a[n], t) for n, t in base_ranks[r].items())  # base copied unchanged


def test_cli_two_step_with_base_only(tiny_pair, tmp_path):
    common = ["--dtype", "bfloat16", "--tp", "2"]
    assert cli(["convert", "--base-model", str(tiny_pair / "base"), "--base-only", "--output",
                str(tmp_path / "base"), *common]) == 0
    assert cli(["convert", "--base-checkpoint", str(tmp_path / "base"), "--drafter", str(tiny_pair / "drafter"),
                "--output", str(tmp_path / "two"), "--num-beams", "4", "--no-greedy"]) == 0
    assert cli(["convert", "--base-model", str(tiny_pair / "base"), "--drafter", str(tiny_pair / "drafter"),
                "--output", str(tmp_path / "one"), "--num-beams", "4", "--no-greedy", *common]) == 0
    assert (tmp_path / "two/config.json").read_bytes() == (tmp_path / "one/config.json").read_bytes()
    cfg = json.loads((tmp_path / "one/config.json").read_text())
    assert cfg["redrafter_num_beams"] == 4 and cfg["redrafter_greedy_search"] is False
    assert cfg["redrafter_draft_len_per_beam"] == 5  # TensorRT-LLM's default
    for a, b in zip(read_rank_files(tmp_path / "two", 2), read_rank_files(tmp_path / "one", 2)):
        assert all(torch.equal(a[n], b[n]) for n in a) and set(a) == set(b)


def test_cli_recipe_defaults_and_flag_override(tiny_pair, tmp_path):
    out = tmp_path / "ckpt"
    assert cli(["convert", "--config", str(RECIPES / "tiny.yaml"), "--base-model", str(tiny_pair / "base"),
                "--drafter", str(tiny_pair / "drafter"), "--output", str(out), "--tp", "2",
                "--draft-len-per-beam", "3"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["redrafter_num_beams"] == 3 and cfg["redrafter_draft_len_per_beam"] == 3  # recipe, then flag
    assert cfg["dtype"] == "float32"  # recipe convert.dtype
    # --force replaces a complete checkpoint; nothing temporary is left beside it
    assert cli(["convert", "--base-model", str(tiny_pair / "base"), "--drafter", str(tiny_pair / "drafter"),
                "--output", str(out), "--tp", "1", "--force"]) == 0
    assert json.loads((out / "config.json").read_text())["mapping"]["tp_size"] == 1
    assert not (out / "rank1.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
