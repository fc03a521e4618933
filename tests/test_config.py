"""config.json as TensorRT-LLM writes it (both formats), `parse_checkpoint_config` round trip, and the recipes."""

from __future__ import annotations

from pathlib import Path

import pytest

from trt_redrafter.checkpoint.convert import ConvertConfig, check_recipe_model
from trt_redrafter.checkpoint.tiny import TinyConfig
from trt_redrafter.checkpoint.trtllm_config import (REDRAFTER_KEYS, add_redrafter_keys, build_pretrained_config,
                                                    llama_pretrained_config, parse_checkpoint_config)
from trt_redrafter.config import BuildConfig, DrafterConfig, ModelConfig, ReDrafterConfig, load_recipe
from trt_redrafter.errors import UserError

RECIPES = Path(__file__).resolve().parents[1] / "builders"
MODEL = ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=32, rotary_scaling={"type": "linear", "factor": 2.0})
DRAFTER = DrafterConfig(vocab_size=32000, hidden_size=4096, exit_dim=8192, num_draft_layers=2, rnn=True)
RD = ReDrafterConfig(num_beams=6, draft_len_per_beam=4, greedy_search=True)


def test_1x_layout():
    cfg = build_pretrained_config(MODEL, DRAFTER, RD, tp=4, fmt="1.x")
    keys = list(cfg)
    # LLaMAConfig sets its own fields before PretrainedConfig's, so they come first; ours come last
    assert keys[:4] == ["mlp_bias", "attn_bias", "rotary_base", "rotary_scaling"]
    assert keys.index("architecture") == 16 and cfg["architecture"] == "ReDrafterForLLaMALM"
    assert keys[-9:] == ["tie_word_embeddings", "base_model_architecture", *REDRAFTER_KEYS]
    assert cfg["base_model_architecture"] == "LlamaForCausalLM"
    assert [cfg[k] for k in REDRAFTER_KEYS] == [2, 4096, 8192, True, 6, 4, True]
    assert cfg["mapping"] == {"world_size": 4, "gpus_per_node": 8, "cp_size": 1, "tp_size": 4, "pp_size": 1,
                              "moe_tp_size": 4, "moe_cluster_size": 1, "moe_ep_size": 1, "attn_tp_size": 4,
                              "attn_cp_size": 1, "cp_config": {}}
    assert cfg["quantization"]["quant_algo"] is None and cfg["quantization"]["exclude_modules"] is None
    assert (cfg["position_embedding_type"], cfg["head_size"], cfg["rotary_embedding_dim"]) == ("rope_gpt_neox", 128,
                                                                                              128)
    assert cfg["rotary_scaling"] == {"type": "linear", "factor": 2.0} and cfg["norm_epsilon"] == 1e-6
    assert cfg["logits_dtype"] == "float32" and cfg["dtype"] == "float16" and cfg["vocab_size"] == 32000


def test_legacy_layout():
    cfg = build_pretrained_config(MODEL, DRAFTER, RD, tp=2, fmt="legacy")
    keys = list(cfg)
    assert keys[0] == "architecture" and cfg["architecture"] == "ReDrafterForCausalLM"
    assert "moe" not in cfg and "runtime_defaults" not in cfg and cfg["share_embedding_table"] is False
    assert keys[-10:] == ["rotary_base", "rotary_scaling", "base_model_architecture", *REDRAFTER_KEYS]
    assert cfg["mapping"]["tp_size"] == cfg["mapping"]["world_size"] == 2


def test_quantized_base_keeps_drafter_unquantized():
    base = llama_pretrained_config(MODEL, 1)
    base["quantization"].update(quant_algo="FP8", exclude_modules=["lm_head"])
    cfg = add_redrafter_keys(base, DRAFTER, RD)
    assert cfg["quantization"]["exclude_modules"] == [
        "lm_head", "drafter", "drafter.layers", "drafter.lm_head", "drafter.rnn_u", "drafter.rnn_w",
        "drafter.layers.0", "drafter.layers.0.linear", "drafter.layers.1", "drafter.layers.1.linear"]
    assert base["quantization"]["exclude_modules"] == ["lm_head"]  # input not mutated


@pytest.mark.parametrize("fmt", ["1.x", "legacy"])
def test_parse_roundtrip(fmt):
    gqa = MODEL.replace(num_key_value_heads=8, rotary_scaling=None, tie_word_embeddings=fmt == "1.x",
                        dtype="bfloat16", norm_epsilon=1e-5, rotary_base=5e5)
    info = parse_checkpoint_config(build_pretrained_config(gqa, DRAFTER, RD, 4, fmt), "cfg")
    assert info.model == gqa and info.drafter == DRAFTER and info.redrafter == RD
    assert info.tp_size == 4 and info.architecture.startswith("ReDrafterFor") and "mapping" in info.raw


@pytest.mark.parametrize("arch,bias,qk_norm", [("Qwen2ForCausalLM", True, False), ("Qwen3ForCausalLM", False, True)])
def test_parse_roundtrip_of_a_qwen_base(arch, bias, qk_norm):
    qwen = MODEL.replace(architecture=arch, attn_bias=bias, qk_layernorm=qk_norm, rotary_scaling=None)
    cfg = build_pretrained_config(qwen, DRAFTER, RD, 2)
    assert cfg["architecture"] == "ReDrafterForQWenLM" and cfg["qwen_type"] == arch[:5].lower()
    info = parse_checkpoint_config(cfg, "cfg")
    assert info.model == qwen and info.drafter == DRAFTER and info.redrafter == RD


def test_parse_accepts_hf_style_rope_type():
    cfg = build_pretrained_config(MODEL, DRAFTER, RD, 1)
    cfg["rotary_scaling"] = {"rope_type": "dynamic", "factor": 2.0}  # how TensorRT-LLM copies a 4.x HF config
    assert parse_checkpoint_config(cfg, "cfg").model.rotary_scaling["type"] == "dynamic"


@pytest.mark.parametrize("mutate,needle", [
    (lambda c: c.pop("redrafter_num_beams"), "redrafter_num_beams"),
    (lambda c: c.update(architecture="LlamaForCausalLM"), "not a ReDrafter architecture"),
    (lambda c: c.update(dtype="int8"), "dtype"),
    (lambda c: c["mapping"].update(pp_size=2), "pp_size"),
    (lambda c: c.update(redrafter_num_beams=0), "num_beams"),
    (lambda c: c.update(base_model_architecture="MistralForCausalLM"), "MistralForCausalLM"),
])
def test_parse_refusals(mutate, needle):
    cfg = build_pretrained_config(MODEL, DRAFTER, RD, 2)
    mutate(cfg)
    with pytest.raises(UserError, match=needle):
        parse_checkpoint_config(cfg, "somewhere/config.json")


# ---- recipes -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,dims", [
    ("vicuna-7b", (4096, 11008, 32, 32)), ("vicuna-13b", (5120, 13824, 40, 40)), ("vicuna-33b", (6656, 17920, 60, 52)),
])
def test_vicuna_recipes(name, dims):
    r = load_recipe(RECIPES / f"{name}.yaml")
    m = ModelConfig.from_dict(r["model"])
    assert (m.hidden_size, m.intermediate_size, m.num_hidden_layers, m.num_attention_heads) == dims
    assert (m.vocab_size, m.max_position_embeddings, m.norm_epsilon) == (32000, 2048, 1e-6)
    assert ReDrafterConfig.from_sources(r, None) == RD
    BuildConfig.from_sources(r, None)
    c = ConvertConfig.from_sources(r, None)
    assert (c.dtype, c.trtllm_format) == ("float16", "1.x")
    check_recipe_model(r["model"], m, name)
    with pytest.raises(UserError, match="hidden_size"):
        check_recipe_model(r["model"], m.replace(hidden_size=m.hidden_size * 2), name)


def test_tiny_recipe_agrees_with_make_tiny():
    r = load_recipe(RECIPES / "tiny.yaml")
    t = TinyConfig.from_sources(r, None)
    m = ModelConfig.from_dict(r["model"])
    assert (m.vocab_size, m.hidden_size, m.intermediate_size, m.num_hidden_layers, m.num_attention_heads,
            m.num_key_value_heads, m.max_position_embeddings) == (
        t.vocab_size, t.hidden_size, t.intermediate_size, t.num_layers, t.num_heads, t.num_kv_heads,
        t.max_position_embeddings)
    assert ReDrafterConfig.from_sources(r, None).max_draft_tokens <= 8


def test_convert_config_validation():
    with pytest.raises(UserError, match="trtllm_format"):
        ConvertConfig.from_dict({"trtllm_format": "2.0"})
    with pytest.raises(UserError, match="workers"):
        ConvertConfig.from_dict({"workers": 0})
    assert ConvertConfig.from_dict({}).tp is None


def _parser(*configs):
    import argparse

    p = argparse.ArgumentParser()
    for c in configs:
        c.add_cli_args(p)
    return p


def test_a_config_reads_only_its_own_flags():
    """BuildConfig's --dtype shares a field name with ConvertConfig.dtype: it sets only BuildConfig's, and a command
    that means it for both says so (`flags=`), as build-engine does for --tp, --dtype and --workers."""
    p = _parser(BuildConfig, ReDrafterConfig)
    ConvertConfig.add_cli_args(p, only=("trtllm_format",))
    args = p.parse_args(["--dtype", "bfloat16", "--trtllm-format", "legacy"])
    assert BuildConfig.from_sources(None, args).dtype == "bfloat16"
    convert = ConvertConfig.from_sources(None, args)
    assert convert.dtype is None and convert.trtllm_format == "legacy"
    assert ConvertConfig.from_sources(None, args, flags={"dtype": args.dtype, "tp": None}).dtype == "bfloat16"
    # flags beat the recipe; a flag not given (None) leaves it
    recipe = {"convert": {"dtype": "float16", "tp": 2}}
    mapped = ConvertConfig.from_sources(recipe, args, flags={"dtype": "float32", "tp": None})
    assert (mapped.dtype, mapped.tp) == ("float32", 2)


def test_no_greedy_is_an_alias_of_no_greedy_search():
    p = _parser(ReDrafterConfig)
    assert ReDrafterConfig.from_sources(None, p.parse_args(["--no-greedy"])).greedy_search is False
    assert ReDrafterConfig.from_sources(None, p.parse_args(["--no-greedy-search"])).greedy_search is False
    assert ReDrafterConfig.from_sources(None, p.parse_args([])).greedy_search is True


def test_train_drafter_flags_come_from_its_config():
    """train-drafter's flags are DrafterTrainConfig's fields (one place for flag, help and default): every CLI field
    has a flag, no flag given leaves the config's default, a flag given sets only its field, and the one-data-source
    rule is the config's check."""
    import argparse
    import dataclasses

    from trt_redrafter.commands import train_drafter
    from trt_redrafter.errors import UserError
    from trt_redrafter.training.config import DrafterTrainConfig

    top = argparse.ArgumentParser()
    train_drafter.register(top.add_subparsers())
    base = ["train-drafter", "--base-model", "b", "--output", "o"]
    args = top.parse_args(base)
    assert DrafterTrainConfig.from_sources(None, args) == DrafterTrainConfig()
    cli_fields = [f.name for f in dataclasses.fields(DrafterTrainConfig) if f.metadata.get("cli", True)]
    assert set(getattr(args, DrafterTrainConfig._owned_key())) == set(cli_fields)
    args = top.parse_args(base + ["--draft-len", "3", "--no-rnn", "--lr", "0.01", "--magpie", "--dtype", "bfloat16"])
    cfg = DrafterTrainConfig.from_sources(None, args)
    assert (cfg.draft_len, cfg.rnn, cfg.lr, cfg.magpie, cfg.dtype) == (3, False, 0.01, True, "bfloat16")
    assert dataclasses.replace(cfg, draft_len=4, rnn=True, lr=2e-3, magpie=False, dtype="float32") == \
        DrafterTrainConfig()
    with pytest.raises(UserError, match="one data source"):
        DrafterTrainConfig.from_sources(None, top.parse_args(base + ["--magpie", "--prompts", "p.jsonl"]))
