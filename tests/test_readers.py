"""Readers of the inputs: HF Llama directories as transformers 4.x / 5.x write them (configs, sharded safetensors,
.bin), and Apple drafter directories with TensorRT-LLM's alternative tensor prefixes."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from trt_redrafter.checkpoint.drafter import read_drafter
from trt_redrafter.checkpoint.hf import model_config_from_hf, read_hf_model, rope_from_hf
from trt_redrafter.errors import UserError

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 384, "hidden_size": 64,
         "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 512, "rms_norm_eps": 1e-5}


def all_tensors(ckpt) -> dict[str, torch.Tensor]:
    return {n: ckpt.get(n) for n in ckpt.names()}


# ---- config.json variants --------------------------------------------------------------------------------------

def test_transformers5_config(tiny_pair):
    """make-tiny writes with transformers 5: `dtype` and `rope_parameters`."""
    raw = json.loads((tiny_pair / "base" / "config.json").read_text())
    assert "rope_parameters" in raw or "rope_theta" in raw
    ckpt = read_hf_model(tiny_pair / "base")
    assert ckpt.source_dtype == ckpt.config.dtype == "float32"  # the stored dtype unless one is asked for
    assert read_hf_model(tiny_pair / "base", dtype="bfloat16").config.dtype == "bfloat16"
    c = ckpt.config
    assert (c.num_key_value_heads, c.head_size, c.rotary_base, c.rotary_scaling) == (2, 16, 10000.0, None)
    assert c.norm_epsilon == 1e-6 and c.max_position_embeddings == 512


def test_transformers4_style_config():
    cfg = model_config_from_hf({**LLAMA, "torch_dtype": "bfloat16", "rope_theta": 500000.0}, "x")
    assert cfg.dtype == "bfloat16" and cfg.rotary_base == 500000.0 and cfg.norm_epsilon == 1e-5
    assert model_config_from_hf({**LLAMA, "torch_dtype": "float16"}, "x", dtype="float32").dtype == "float32"
    # num_key_value_heads absent (old Llama configs) means multi-head attention; head_dim honoured
    old = {k: v for k, v in LLAMA.items() if k != "num_key_value_heads"}
    assert model_config_from_hf(old, "x").num_key_value_heads == 4
    assert model_config_from_hf({**LLAMA, "head_dim": 32}, "x").head_size == 32


@pytest.mark.parametrize("cfg,expected", [
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, (10000.0, {"type": "linear", "factor": 2.0})),
    ({"rope_theta": 1e6, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}},
     (1e6, {"rope_type": "dynamic", "factor": 4.0, "type": "dynamic"})),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}},
     (10000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192, "type": "llama3"})),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}},
     (5e5, {"rope_type": "linear", "factor": 2.0, "type": "linear"})),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}, (5e5, None)),
    ({"rope_scaling": None}, (10000.0, None)),
])
def test_rope_variants(cfg, expected):
    assert rope_from_hf(cfg, "x") == expected
    assert model_config_from_hf({**LLAMA, **cfg}, "x").rotary_scaling == expected[1]  # passes ModelConfig checks


def test_unsupported_rope_and_arch_refused():
    with pytest.raises(UserError, match="yarn"):
        rope_from_hf({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "x")
    with pytest.raises(UserError, match="MistralForCausalLM"):
        model_config_from_hf({**LLAMA, "architectures": ["MistralForCausalLM"], "model_type": "mistral"}, "x")
    with pytest.raises(UserError, match="intermediate_size"):
        model_config_from_hf({k: v for k, v in LLAMA.items() if k != "intermediate_size"}, "x")


# ---- weight layouts --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference(tiny_pair):
    return load_file(str(tiny_pair / "base" / "model.safetensors"))


def test_sharded_safetensors(tiny_pair, tmp_path, reference):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_pair / "base")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    got = all_tensors(read_hf_model(tmp_path / "sharded"))
    assert set(got) == set(reference) and all(torch.equal(got[n], reference[n]) for n in reference)


def test_single_bin(tiny_pair, tmp_path, reference):
    d = tmp_path / "bin"
    d.mkdir()
    shutil.copy(tiny_pair / "base" / "config.json", d)
    torch.save(reference, d / "pytorch_model.bin")
    got = all_tensors(read_hf_model(d))
    assert set(got) == set(reference) and all(torch.equal(got[n], reference[n]) for n in reference)


def test_sharded_bin_with_index(tiny_pair, tmp_path, reference):
    d = tmp_path / "bins"
    d.mkdir()
    shutil.copy(tiny_pair / "base" / "config.json", d)
    names = sorted(reference)
    halves = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
    for fname, part in halves.items():
        torch.save({n: reference[n] for n in part}, d / fname)
    wm = {n: f for f, part in halves.items() for n in part}
    (d / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    ckpt = read_hf_model(d)
    assert ckpt.get("lm_head.weight").equal(reference["lm_head.weight"])
    assert all(torch.equal(ckpt.get(n), reference[n]) for n in names)


def test_bin_loaded_weights_only(tiny_pair, tmp_path):
    """A pickle that is more than tensors is refused, not executed."""
    d = tmp_path / "evil"
    d.mkdir()
    shutil.copy(tiny_pair / "base" / "config.json", d)
    torch.save({"x": torch.zeros(1), "obj": Exception("not a tensor")}, d / "pytorch_model.bin")
    with pytest.raises(UserError, match="pytorch_model.bin"):
        read_hf_model(d)


def test_index_naming_missing_shard(tiny_pair, tmp_path):
    d = tmp_path / "broken"
    d.mkdir()
    shutil.copy(tiny_pair / "base" / "config.json", d)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-00001.safetensors"}}))
    with pytest.raises(UserError, match="model-00001.safetensors"):
        read_hf_model(d)


# ---- drafter ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("style", ["lm_heads", "0"])
def test_drafter_alternative_prefixes(make_tiny_pair, tmp_path, style):
    src = make_tiny_pair(exit_dim=96, drafter_layers=2) / "drafter"
    canonical = read_drafter(src).tensors
    d = tmp_path / "drafter"
    shutil.copytree(src, d)

    def rename(n: str) -> str:
        n = n.replace("input_proj.", "input_projs.")
        return f"{style}.{n[len('lm_head.'):]}" if n.startswith("lm_head.") else n

    save_file({rename(n): t for n, t in load_file(str(src / "model.safetensors")).items()},
              str(d / "model.safetensors"))
    got = read_drafter(d).tensors
    assert set(got) == set(canonical) and all(torch.equal(got[n], canonical[n]) for n in canonical)


def test_drafter_model_pt(tiny_pair, tmp_path):
    src = tiny_pair / "drafter"
    d = tmp_path / "drafter"
    d.mkdir()
    shutil.copy(src / "config.json", d)
    torch.save(load_file(str(src / "model.safetensors")), d / "model.pt")
    got, ref = read_drafter(d), read_drafter(src)
    assert got.config == ref.config
    assert all(torch.equal(got.tensors[n], ref.tensors[n]) for n in ref.tensors)


def test_drafter_shape_and_type_checks(tiny_pair, tmp_path):
    d = tmp_path / "drafter"
    shutil.copytree(tiny_pair / "drafter", d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "vocab_size": 400}))
    with pytest.raises(UserError, match=r"lm_head.1.weight has shape \[384, 128\], expected \[400, 128\]"):
        read_drafter(d)
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(UserError, match="recurrent_drafting_drafter"):
        read_drafter(d)
