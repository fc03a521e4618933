"""TensorRT-LLM checkpoint `config.json`: write it as TensorRT-LLM's converters do, and read it back.

Two layouts (TensorRT-LLM's `PretrainedConfig.to_dict()` and `examples/redrafter/convert_checkpoint.py`):

- "1.x" (TensorRT-LLM 1.0-1.2, two-step converter): the LLaMA `LLaMAConfig.to_dict()` of the base checkpoint, key
  order = `__dict__` insertion order (LLaMA fields first, then `PretrainedConfig` fields, then implicit kwargs), then
  `base_model_architecture` and the seven `redrafter_*` keys appended; `architecture` = `ReDrafterForLLaMALM`,
  kept in its original position.
- "legacy" (TensorRT-LLM 0.12-0.21, one-step converter): a plain `PretrainedConfig` with the two rotary kwargs;
  `architecture` = `ReDrafterForCausalLM`. Deviation on purpose: the old converter read HF `rotary_scaling` (a
  name HF never writes) and so always stored null; we store the real scaling so a rope-scaled model is not silently
  mis-rotated.

`mapping` and `quantization` are rebuilt by strict constructors (`Mapping.from_dict` and `QuantConfig.from_dict` are
both `cls(**d)`: an unknown key is a TypeError), and their field lists differ between releases, so the 1.x format
writes only the keys every supported release accepts (`MAPPING_KEYS` / `QUANT_KEYS` below, read from source) and
leaves the rest to the constructors' defaults. Runtimes read only the model keys, `mapping.tp_size` and the
`redrafter_*` keys.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ..config import DTYPES, DrafterConfig, ModelConfig, ReDrafterConfig
from ..errors import UserError
from ..families import ARCHITECTURES, FAMILIES, LLAMA, family_of
from ..fsutil import read_json
from .quantization import DEFAULT_EXCLUDE, Quantization, parse_quantization, quantization_section

FORMATS = ("1.x", "legacy")
LEGACY_ARCH = "ReDrafterForCausalLM"  # TensorRT-LLM 0.12-0.21's one-step format: Llama bases only
# the 1.x format's architecture is the base family's (families.py): ReDrafterForLLaMALM, ReDrafterForQWenLM
REDRAFTER_ARCHITECTURES = tuple(dict.fromkeys(f.redrafter_architecture for f in FAMILIES)) + (LEGACY_ARCH,)
# a drafter whose head scores a frequency-ranked draft vocabulary (tensor `drafter.draft_vocab`): this project's
# runtime only; absent for Apple-format drafters, so every other checkpoint is TensorRT-LLM's format unchanged
DRAFT_VOCAB_KEY = "redrafter_draft_vocab_size"
# a drafter held whole by every TP rank (a TP size that does not divide its dimensions): this project's runtime only
REPLICATED_KEY = "redrafter_drafter_replicated"
REDRAFTER_KEYS = ("redrafter_num_layers", "redrafter_hidden_size", "redrafter_exit_dim", "redrafter_is_rnn",
                  "redrafter_num_beams", "redrafter_draft_len_per_beam", "redrafter_greedy_search")
LOGITS_DTYPE = "float32"  # TensorRT-LLM's default logits_dtype
GPUS_PER_NODE = 8  # Mapping default

# Which `mapping` / `quantization` keys each TensorRT-LLM release line's constructor accepts (NVIDIA/TensorRT-LLM):
# - Mapping.__init__, tensorrt_llm/mapping.py: @05ebebb2 (1.0-era; has auto_parallel, no enable_lm_head_tp_in_adp);
#   @b35ac1b6 (version.py 1.2.0rc2; auto_parallel gone, removed by PR #8329 in Oct 2025 after main moved to 1.2;
#   enable_lm_head_tp_in_adp added by PR #7571 in Sep 2025 while main was 1.1.0rc). `rank` is a parameter too, but
#   PretrainedConfig.to_dict drops it.
# - QuantConfig dataclass fields, tensorrt_llm/models/modeling_utils.py: @01ea6d79 (no mamba_ssm_cache_dtype) and
#   @b35ac1b6 (1.2.0rc2, with it). For 1.1 the field could not be dated, so it counts as not accepted.
# The release commits themselves (1.0.0 ae8270b7, 1.1.0 48b7b5d8) were not readable; lines 0.21/1.0/1.1 are inferred
# from the dated pull requests above (docs/tensorrt-llm.md).
_MAPPING_COMMON = ("world_size", "gpus_per_node", "cp_size", "cp_config", "tp_size", "pp_size", "moe_cluster_size",
                   "moe_tp_size", "moe_ep_size", "attn_tp_size", "attn_cp_size", "enable_attention_dp")
_QUANT_COMMON = ("quant_algo", "kv_cache_quant_algo", "group_size", "smoothquant_val", "clamp_val", "use_meta_recipe",
                 "has_zero_point", "pre_quant_scale", "exclude_modules")
ACCEPTED_KEYS: dict[str, dict[str, frozenset]] = {
    "0.21": {"mapping": frozenset(_MAPPING_COMMON + ("auto_parallel",)), "quantization": frozenset(_QUANT_COMMON)},
    "1.0": {"mapping": frozenset(_MAPPING_COMMON + ("auto_parallel",)), "quantization": frozenset(_QUANT_COMMON)},
    "1.1": {"mapping": frozenset(_MAPPING_COMMON + ("auto_parallel", "enable_lm_head_tp_in_adp")),
            "quantization": frozenset(_QUANT_COMMON)},
    "1.2": {"mapping": frozenset(_MAPPING_COMMON + ("enable_lm_head_tp_in_adp",)),
            "quantization": frozenset(_QUANT_COMMON + ("mamba_ssm_cache_dtype",))},
}
SUPPORTED_LINES = ("1.0", "1.1", "1.2")  # what the 1.x format (and the trtllm backend) must load in
# what the 1.x format writes: keys every supported line accepts, in TensorRT-LLM's own to_dict order
MAPPING_KEYS = tuple(k for k in ("world_size", "gpus_per_node", "cp_size", "tp_size", "pp_size", "moe_tp_size",
                                 "moe_cluster_size", "moe_ep_size", "attn_tp_size", "attn_cp_size", "cp_config")
                     if all(k in ACCEPTED_KEYS[line]["mapping"] for line in SUPPORTED_LINES))
QUANT_KEYS = tuple(k for k in _QUANT_COMMON if all(k in ACCEPTED_KEYS[line]["quantization"] for line in SUPPORTED_LINES))


def unaccepted_keys(config: dict, line: str) -> list[str]:
    """`mapping.X` / `quantization.X` keys of a checkpoint config.json that release line `line` would reject."""
    bad = []
    for section in ("mapping", "quantization"):
        d = config.get(section)
        if isinstance(d, dict):
            bad += [f"{section}.{k}" for k in d if k not in ACCEPTED_KEYS[line][section] | {"rank"}]
    return bad


def _mapping(tp: int, fmt: str) -> dict:
    if fmt == "legacy":
        return {"world_size": tp, "gpus_per_node": GPUS_PER_NODE, "cp_size": 1, "tp_size": tp, "pp_size": 1,
                "moe_tp_size": tp, "moe_ep_size": 1}
    values = {"world_size": tp, "gpus_per_node": GPUS_PER_NODE, "cp_size": 1, "tp_size": tp, "pp_size": 1,
              "moe_tp_size": tp, "moe_cluster_size": 1, "moe_ep_size": 1, "attn_tp_size": tp, "attn_cp_size": 1,
              "cp_config": {}}
    return {k: values[k] for k in MAPPING_KEYS}


def _quantization(fmt: str) -> dict:
    values: dict[str, Any] = {"quant_algo": None, "kv_cache_quant_algo": None, "group_size": 128,
                              "smoothquant_val": 0.5, "clamp_val": None, "use_meta_recipe": False,
                              "has_zero_point": False, "pre_quant_scale": False, "exclude_modules": None}
    if fmt == "legacy":
        del values["use_meta_recipe"]
        return values
    return {k: values[k] for k in QUANT_KEYS}


def _moe() -> dict:
    return {"num_experts": 0, "shared_expert_intermediate_size": 0, "top_k": 0, "normalization_mode": None,
            "sparse_mixer_epsilon": 0.01, "tp_mode": 0, "device_limited_n_group": 0, "device_limited_topk_group": 0,
            "device_limited_routed_scaling_factor": 1.0}


def llama_pretrained_config(m: ModelConfig, tp: int, fmt: str = "1.x", quantize: Optional[str] = None,
                            quantize_lm_head: bool = False, group_size: int = 128) -> dict:
    """The base LLaMA config TensorRT-LLM writes for `m` at TP=tp (no ReDrafter keys); `quantize` (int8_wo,
    int4_wo) sets the weight-only algorithm as TensorRT-LLM's quantize.py does (checkpoint/quantization.py)."""
    if fmt not in FORMATS:
        raise UserError(f"--trtllm-format must be one of {', '.join(FORMATS)}, got {fmt!r}.")
    generic = {
        "architecture": m.architecture, "dtype": m.dtype, "vocab_size": m.vocab_size, "hidden_size": m.hidden_size,
        "num_hidden_layers": m.num_hidden_layers, "num_attention_heads": m.num_attention_heads,
        "hidden_act": m.hidden_act, "logits_dtype": LOGITS_DTYPE, "norm_epsilon": m.norm_epsilon,
    }
    if fmt == "1.x":
        generic["runtime_defaults"] = None
    generic.update({
        "position_embedding_type": "rope_gpt_neox", "num_key_value_heads": m.num_key_value_heads,
        "intermediate_size": m.intermediate_size, "max_position_embeddings": m.max_position_embeddings,
        "mapping": _mapping(tp, fmt), "quantization": {**_quantization(fmt),
                                                        **quantization_section(quantize, quantize_lm_head,
                                                                               group_size)},
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
    })
    if fmt == "legacy":
        generic["share_embedding_table"] = False
    generic.update({"head_size": m.head_size, "qk_layernorm": False, "rotary_embedding_dim": m.head_size})
    if fmt == "legacy":
        return {**generic, "rotary_base": m.rotary_base, "rotary_scaling": m.rotary_scaling}
    llama = {
        "mlp_bias": False, "attn_bias": False, "rotary_base": m.rotary_base, "rotary_scaling": m.rotary_scaling,
        "residual_mlp": False, "disable_weight_only_quant_plugin": False, "moe": _moe(),
        "remove_duplicated_kv_heads": False, "fc_after_embed": False, "use_input_layernorm_in_first_layer": True,
        "use_last_layernorm": True, "layer_idx_offset": 0, "embedding_multiplier": 1.0, "attention_multiplier": 1.0,
        "residual_multiplier": 1.0, "output_multiplier_scale": 1.0,
    }
    return {**llama, **generic, "tie_word_embeddings": m.tie_word_embeddings}


def redrafter_architecture(base_architecture: str, fmt: str) -> str:
    """The ReDrafter architecture TensorRT-LLM's converter writes over this base in format `fmt`."""
    family = family_of(base_architecture)
    if fmt == "legacy":
        if family is not LLAMA:
            raise UserError(f"--trtllm-format legacy writes TensorRT-LLM 0.12-0.21's {LEGACY_ARCH}, which takes Llama "
                            f"bases only; a {base_architecture} base needs --trtllm-format 1.x "
                            f"({family.redrafter_architecture}).")
        return LEGACY_ARCH
    return family.redrafter_architecture


# TensorRT-LLM's QWenConfig (tensorrt_llm/models/qwen/config.py @373970a8): its own fields first (set before
# PretrainedConfig.__init__), then PretrainedConfig's, then the keyword arguments it does not name (stored with
# setattr) in from_hugging_face's order. from_hugging_face: qwen_type = HF model_type; attn_bias False for qwen3,
# else True; mlp_bias never passed (False); seq_length = HF seq_length or 8192 (Qwen2/3 have none; used only with
# use_logn_attn); qk_layernorm not set (QWenForCausalLM derives it from qwen_type).
QWEN_SEQ_LENGTH = 8192


def qwen_pretrained_config(m: ModelConfig, tp: int, quantize: Optional[str] = None, quantize_lm_head: bool = False,
                           group_size: int = 128) -> dict:
    """The base Qwen config TensorRT-LLM 1.x's Qwen converter writes for `m` at TP=tp (no ReDrafter keys)."""
    family = family_of(m.architecture)
    llama = llama_pretrained_config(m, tp, "1.x", quantize, quantize_lm_head, group_size)
    generic = {k: llama[k] for k in ("architecture", "dtype", "vocab_size", "hidden_size", "num_hidden_layers",
                                     "num_attention_heads", "hidden_act", "logits_dtype", "norm_epsilon",
                                     "runtime_defaults", "position_embedding_type", "num_key_value_heads",
                                     "intermediate_size", "max_position_embeddings", "mapping", "quantization",
                                     "use_parallel_embedding", "embedding_sharding_dim", "head_size", "qk_layernorm",
                                     "rotary_embedding_dim")}
    qwen = {"mlp_bias": False, "attn_bias": m.attn_bias, "rotary_base": m.rotary_base,
            "rotary_scaling": m.rotary_scaling, "disable_weight_only_quant_plugin": False, "use_logn_attn": False,
            "moe": _moe(), "num_labels": 1, "mlp_only_layers": [], "decoder_sparse_step": 1}
    extra = {"seq_length": QWEN_SEQ_LENGTH, "qwen_type": family.qwen_type, "moe_intermediate_size": 0,
             "moe_shared_expert_intermediate_size": 0, "tie_word_embeddings": m.tie_word_embeddings}
    return {**qwen, **generic, **extra}


def base_pretrained_config(m: ModelConfig, tp: int, fmt: str = "1.x", quantize: Optional[str] = None,
                           quantize_lm_head: bool = False, group_size: int = 128) -> dict:
    """The base config TensorRT-LLM's converter of `m`'s family writes (LLaMAConfig or QWenConfig)."""
    if family_of(m.architecture).qwen_type is None:
        return llama_pretrained_config(m, tp, fmt, quantize, quantize_lm_head, group_size)
    redrafter_architecture(m.architecture, fmt)  # refuses the legacy format for a Qwen base
    return qwen_pretrained_config(m, tp, quantize, quantize_lm_head, group_size)


def add_redrafter_keys(base: dict, drafter: DrafterConfig, redrafter: ReDrafterConfig, fmt: str = "1.x") -> dict:
    """TensorRT-LLM's `hf_redrafter_config`: the base config plus the ReDrafter architecture and keys."""
    out = json.loads(json.dumps(base))  # deep copy, JSON types only
    out["base_model_architecture"] = base["architecture"]
    out["architecture"] = redrafter_architecture(base["architecture"], fmt)  # an existing key keeps its position
    out.update({
        "redrafter_num_layers": drafter.num_draft_layers, "redrafter_hidden_size": drafter.hidden_size,
        "redrafter_exit_dim": drafter.exit_dim, "redrafter_is_rnn": drafter.rnn,
        "redrafter_num_beams": redrafter.num_beams, "redrafter_draft_len_per_beam": redrafter.draft_len_per_beam,
        "redrafter_greedy_search": redrafter.greedy_search,
    })
    if drafter.draft_vocab_size:  # this project's extension (FR-Spec draft vocabulary); TensorRT-LLM has no such key
        out[DRAFT_VOCAB_KEY] = drafter.draft_vocab_size
    if drafter.replicated:  # this project's extension too (draft TP 1)
        out[REPLICATED_KEY] = True
    q = out.get("quantization") or {}
    if q.get("quant_algo") and q.get("exclude_modules") is None:
        # null means TensorRT-LLM's default list, and its converter adds the drafter only to a list that exists
        # (it would quantize the drafter): write the default out
        q["exclude_modules"] = list(DEFAULT_EXCLUDE)
    if q.get("exclude_modules") is not None:  # a quantized base: keep the drafter unquantized
        q["exclude_modules"] += ["drafter", "drafter.layers", "drafter.lm_head"]
        if drafter.has_input_proj:  # not in TensorRT-LLM's list, which would quantize this float layer
            q["exclude_modules"] += ["drafter.input_proj"]
        if drafter.rnn:
            q["exclude_modules"] += ["drafter.rnn_u", "drafter.rnn_w"]
        for j in range(drafter.num_draft_layers):
            q["exclude_modules"] += [f"drafter.layers.{j}", f"drafter.layers.{j}.linear"]
    return out


def build_pretrained_config(model: ModelConfig, drafter: DrafterConfig, redrafter: ReDrafterConfig, tp: int,
                            fmt: str = "1.x", quantize: Optional[str] = None, quantize_lm_head: bool = False,
                            group_size: int = 128) -> dict:
    """The ReDrafter checkpoint config.json TensorRT-LLM's converter writes (one-step equivalent of two steps)."""
    return add_redrafter_keys(base_pretrained_config(model, tp, fmt, quantize, quantize_lm_head, group_size),
                              drafter, redrafter, fmt)


def write_config(path: str | Path, config: dict) -> None:
    """`json.dump(config, f, indent=4)` exactly as TensorRT-LLM writes it (no sorting, no trailing newline)."""
    with open(path, "w") as f:
        json.dump(config, f, indent=4)


# ---- reading -------------------------------------------------------------------------------------------------

@dataclass
class CheckpointInfo:
    """What a runtime needs from a checkpoint config.json: a ReDrafter checkpoint, or a plain LLaMA one (drafter and
    redrafter None: an engine built from it drafts with the learning-free proposers)."""

    model: ModelConfig
    drafter: Optional[DrafterConfig]
    redrafter: Optional[ReDrafterConfig]
    tp_size: int
    architecture: str
    raw: dict
    quant: Optional[Quantization] = None  # the base's quantization (checkpoint/quantization.py)


def _need(d: dict, keys: tuple[str, ...], where: str, what: str) -> None:
    missing = [k for k in keys if k not in d]
    if missing:
        raise UserError(f"{where}: missing key(s) {', '.join(missing)}; is this a {what} config.json?")


def tp_size_of(d: dict, where: str) -> int:
    mapping = d.get("mapping")
    tp = mapping.get("tp_size") if isinstance(mapping, dict) else None
    if not isinstance(tp, int) or tp < 1 or (mapping.get("pp_size", 1) or 1) != 1:
        raise UserError(f"{where}: mapping must have a positive tp_size and pp_size 1, got {mapping!r}.")
    return tp


def model_config_from_trtllm(d: dict, where: str) -> ModelConfig:
    """The base model of a TensorRT-LLM LLaMA (or ReDrafter) config dict."""
    _need(d, ("architecture", "dtype", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "intermediate_size"), where, "TensorRT-LLM checkpoint")
    arch = d.get("base_model_architecture", d["architecture"])
    if arch not in ARCHITECTURES:
        raise UserError(f"{where}: base architecture {arch!r} is not one this project handles "
                        f"({', '.join(ARCHITECTURES)}).")
    family = family_of(arch)
    scaling = d.get("rotary_scaling")
    if isinstance(scaling, dict) and "type" not in scaling and "rope_type" in scaling:
        scaling = {**scaling, "type": scaling["rope_type"]}
    return ModelConfig.from_dict(dict(
        vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
        num_hidden_layers=d["num_hidden_layers"], num_attention_heads=d["num_attention_heads"],
        num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
        head_size=d.get("head_size") or d["hidden_size"] // d["num_attention_heads"],
        max_position_embeddings=d.get("max_position_embeddings") or 2048,
        norm_epsilon=float(d.get("norm_epsilon", 1e-6)), rotary_base=float(d.get("rotary_base", 10000.0)),
        rotary_scaling=scaling, hidden_act=d.get("hidden_act", "silu"),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)), dtype=d["dtype"], architecture=arch,
        # QWenConfig leaves qk_layernorm False and QWenForCausalLM takes it from qwen_type (qwen3)
        attn_bias=bool(d.get("attn_bias", family.attn_bias)),
        qk_layernorm=bool(d.get("qk_layernorm", False)) or d.get("qwen_type") == "qwen3",
    ), where=where)


def parse_checkpoint_config(d: dict, where: str) -> CheckpointInfo:
    """Read a ReDrafter checkpoint (or engine `pretrained_config`) dict; raise UserError naming what is wrong.

    A plain TensorRT-LLM LLaMA config (no `redrafter_*` keys) reads as a base without a drafter."""
    if not isinstance(d, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(d).__name__}.")
    if d.get("architecture") in ARCHITECTURES and not any(k in d for k in REDRAFTER_KEYS):
        if d.get("dtype") not in DTYPES:
            raise UserError(f"{where}: dtype must be one of {', '.join(DTYPES)}, got {d.get('dtype')!r}.")
        return CheckpointInfo(model_config_from_trtllm(d, where), None, None, tp_size_of(d, where),
                              d["architecture"], d, parse_quantization(d, where))
    _need(d, REDRAFTER_KEYS, where, "ReDrafter checkpoint (converted with `trt-redrafter convert`)")
    arch = d.get("architecture")
    if arch not in REDRAFTER_ARCHITECTURES:
        raise UserError(f"{where}: architecture {arch!r} is not a ReDrafter architecture "
                        f"({', '.join(REDRAFTER_ARCHITECTURES)}).")
    if d.get("dtype") not in DTYPES:
        raise UserError(f"{where}: dtype must be one of {', '.join(DTYPES)}, got {d.get('dtype')!r}.")
    model = model_config_from_trtllm(d, where)
    drafter = DrafterConfig.from_dict(dict(
        vocab_size=model.vocab_size, hidden_size=d["redrafter_hidden_size"], exit_dim=d["redrafter_exit_dim"],
        num_draft_layers=d["redrafter_num_layers"], rnn=d["redrafter_is_rnn"],
        draft_vocab_size=d.get(DRAFT_VOCAB_KEY, 0), replicated=d.get(REPLICATED_KEY, False)),
        where=f"{where} (redrafter_*)")
    redrafter = ReDrafterConfig.from_dict(dict(
        num_beams=d["redrafter_num_beams"], draft_len_per_beam=d["redrafter_draft_len_per_beam"],
        greedy_search=d["redrafter_greedy_search"]), where=f"{where} (redrafter_*)")
    return CheckpointInfo(model, drafter, redrafter, tp_size_of(d, where), arch, d, parse_quantization(d, where))


@dataclass
class TrtllmCheckpoint:
    """A plain TensorRT-LLM LLaMA checkpoint directory (input of the two-step conversion)."""

    path: Path
    raw: dict
    model: ModelConfig
    tp_size: int

    def rank_file(self, rank: int) -> Path:
        return self.path / f"rank{rank}.safetensors"


def read_trtllm_checkpoint(path: str | Path) -> TrtllmCheckpoint:
    """Open a TensorRT-LLM LLaMA checkpoint: config.json + rank{r}.safetensors for every TP rank."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"base checkpoint directory {path} does not exist.")
    where = str(path / "config.json")
    raw = read_json(path / "config.json", "base checkpoint config")
    if any(k in raw for k in REDRAFTER_KEYS):
        raise UserError(f"{where} is already a ReDrafter checkpoint; pass the plain base LLaMA checkpoint.")
    if raw.get("architecture") not in ARCHITECTURES:
        raise UserError(f"{where}: architecture {raw.get('architecture')!r} is not a base this project handles "
                        f"({', '.join(ARCHITECTURES)}).")
    ckpt = TrtllmCheckpoint(path, raw, model_config_from_trtllm(raw, where), tp_size_of(raw, where))
    missing = [ckpt.rank_file(r).name for r in range(ckpt.tp_size) if not ckpt.rank_file(r).is_file()]
    if missing:
        raise UserError(f"base checkpoint {path} (tp_size={ckpt.tp_size}) lacks {', '.join(missing)}.")
    return ckpt
