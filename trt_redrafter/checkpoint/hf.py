"""Read a Hugging Face Llama/Vicuna, Qwen2/Qwen2.5 or Qwen3 directory: its config as a `ModelConfig` and its
tensors, lazily.

Accepts what transformers 4.x and 5.x write: `torch_dtype` or `dtype`; `rope_theta`/`rope_scaling` (4.x) or
`rope_parameters` (5.x, theta inside); `head_dim`; one `model.safetensors` or shards with
`model.safetensors.index.json`; `pytorch_model.bin` (or shards with its index), loaded only with
`torch.load(weights_only=True, mmap=True)`. Tensors are read one at a time (safetensors `safe_open`), so converting
a 7B model never holds two copies of it. Knows nothing about TensorRT-LLM names or TP.
"""

from __future__ import annotations

import pickle
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import SafetensorError, safe_open

from ..config import DTYPES, ModelConfig
from ..errors import UserError
from ..families import FAMILIES, LLAMA, Family
from ..fsutil import read_json
from ..log import get_logger
from ..rope import SUPPORTED_SCALING

log = get_logger(__name__)

SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
TORCH_BIN, TORCH_BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
# HF torch_dtype strings -> our names (HF writes "float16", "bfloat16", "float32"; old files may say "fp16")
_DTYPE_ALIASES = {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32", "float": "float32"}


def rope_from_hf(cfg: dict, where: str) -> tuple[float, Optional[dict]]:
    """(rotary_base, rotary_scaling) from an HF config dict, 4.x or 5.x style.

    TensorRT-LLM copies HF `rope_scaling` verbatim into `rotary_scaling` and reads `type` or `rope_type` from it;
    we keep the HF keys (minus 5.x's `rope_theta`) and make sure `type` is present so both readers agree.
    """
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else None
    theta = cfg.get("rope_theta", params.get("rope_theta") if params else None)
    base = float(theta) if theta is not None else 10000.0
    scaling = cfg.get("rope_scaling") or params
    if not scaling:
        return base, None
    if not isinstance(scaling, dict):
        raise UserError(f"{where}: rope_scaling must be a mapping, got {scaling!r}.")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return base, None
    if kind not in SUPPORTED_SCALING:
        raise UserError(f"{where}: RoPE scaling type {kind!r} is not supported; supported: "
                        f"{', '.join(SUPPORTED_SCALING)}.")
    out = {k: v for k, v in scaling.items() if k != "rope_theta"}
    out["type"] = kind
    return base, out


def normalize_dtype(value: Any, where: str) -> Optional[str]:
    """HF `torch_dtype`/`dtype` string -> one of DTYPES, None when absent."""
    if value is None:
        return None
    name = _DTYPE_ALIASES.get(str(value), str(value).removeprefix("torch."))
    if name not in DTYPES:
        raise UserError(f"{where}: dtype {value!r} is not supported; expected one of {', '.join(DTYPES)}.")
    return name


def family_from_hf(cfg: dict, where: str) -> Family:
    """The family of an HF config.json dict, by `architectures[0]` (else `model_type`; neither: Llama, as old Vicuna
    files have none)."""
    archs = cfg.get("architectures") or []
    for f in FAMILIES:
        if (archs and archs[0] == f.architecture) or (not archs and cfg.get("model_type") == f.model_type):
            return f
    if not archs and cfg.get("model_type") is None:
        return LLAMA
    raise UserError(f"{where}: architecture {(archs or [cfg.get('model_type')])[0]!r} is not supported; this "
                    f"converter handles {', '.join(f.architecture for f in FAMILIES)} (Vicuna is a Llama).")


def model_config_from_hf(cfg: dict, where: str, dtype: str | None = None) -> ModelConfig:
    """A `ModelConfig` from an HF config.json dict of a supported family; `dtype` overrides the stored one."""
    family = family_from_hf(cfg, where)
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in cfg]
    if missing:
        raise UserError(f"{where}: missing key(s) {', '.join(missing)}; is this a Hugging Face "
                        f"{family.architecture} config.json?")
    if cfg.get("use_sliding_window"):
        raise UserError(f"{where}: use_sliding_window is true; this runtime attends to the whole context and cannot "
                        f"honour a sliding window (Qwen2.5 checkpoints set it false).")
    base, scaling = rope_from_hf(cfg, where)
    stored = normalize_dtype(cfg.get("dtype", cfg.get("torch_dtype")), where)
    heads = cfg["num_attention_heads"]
    d = dict(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_size=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        norm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)), rotary_base=base, rotary_scaling=scaling,
        hidden_act=cfg.get("hidden_act", "silu"), tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        dtype=dtype or stored or "float16", architecture=family.architecture,
        attn_bias=family.attn_bias or bool(cfg.get("attention_bias", False)), qk_layernorm=family.qk_layernorm,
    )
    return ModelConfig.from_dict(d, where=where)


@dataclass
class HFCheckpoint:
    """A base model directory: config plus a lazy tensor accessor. `get("lm_head.weight")` resolves tied
    embeddings."""

    path: Path
    config: ModelConfig
    source_dtype: Optional[str]
    weight_map: dict[str, str]  # tensor name -> file name in `path`
    _handles: dict[str, Any] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def tied(self) -> bool:
        """lm_head shares the embedding: declared tied, or no lm_head.weight stored."""
        return self.config.tie_word_embeddings or "lm_head.weight" not in self.weight_map

    def names(self) -> list[str]:
        return sorted(self.weight_map)

    def missing(self, names: list[str]) -> list[str]:
        return [n for n in names if n not in self.weight_map and not (n == "lm_head.weight" and self.tied)]

    def get(self, name: str) -> torch.Tensor:
        """The full tensor `name` as stored (dtype unchanged)."""
        if name == "lm_head.weight" and self.tied:
            name = "model.embed_tokens.weight"
        if name not in self.weight_map:
            raise UserError(f"{self.path}: tensor {name} is missing from the checkpoint.")
        fname = self.weight_map[name]
        with self._lock:  # opening and reading through one handle is not thread-safe
            h = self._handles.get(fname) or self._open(fname)
            return h.get_tensor(name) if hasattr(h, "get_tensor") else h[name]

    def _open(self, fname: str):
        p = self.path / fname
        if fname.endswith(".safetensors"):
            try:
                h = safe_open(str(p), framework="pt", device="cpu")
            except (OSError, SafetensorError) as e:
                raise UserError(f"cannot read {p}: {e}.") from e
        else:
            h = _load_bin(p)
        self._handles[fname] = h
        return h


def _load_bin(p: Path) -> dict:
    try:
        sd = torch.load(p, map_location="cpu", weights_only=True, mmap=True)
    except (OSError, RuntimeError, pickle.UnpicklingError) as e:
        raise UserError(f"cannot read {p} as a PyTorch weights file (weights only): {e}.") from e
    if not isinstance(sd, dict):
        raise UserError(f"{p} holds a {type(sd).__name__}, expected a state dict of tensors.")
    return sd


def _weight_map(path: Path) -> dict[str, str]:
    """tensor name -> file, from an index, a single safetensors file, or a single .bin (safetensors preferred)."""
    for index in (SAFETENSORS_INDEX, TORCH_BIN_INDEX):
        if (path / index).is_file():
            wm = read_json(path / index, "weights index").get("weight_map")
            if not isinstance(wm, dict) or not wm:
                raise UserError(f"{path / index} has no 'weight_map'; re-save the model with save_pretrained.")
            for f in sorted(set(wm.values())):
                if not (path / f).is_file():
                    raise UserError(f"{path / index} lists {f}, but {path / f} does not exist.")
            return dict(wm)
    if (path / SAFETENSORS).is_file():
        try:
            with safe_open(str(path / SAFETENSORS), framework="pt", device="cpu") as h:
                return {k: SAFETENSORS for k in h.keys()}
        except (OSError, SafetensorError) as e:
            raise UserError(f"cannot read {path / SAFETENSORS}: {e}.") from e
    if (path / TORCH_BIN).is_file():
        return {k: TORCH_BIN for k in _load_bin(path / TORCH_BIN)}
    raise UserError(f"{path} has no weights: expected {SAFETENSORS}, {SAFETENSORS_INDEX}, {TORCH_BIN} or "
                    f"{TORCH_BIN_INDEX}.")


def read_hf_model(path: str | Path, dtype: str | None = None) -> HFCheckpoint:
    """Open a Hugging Face base model directory. `dtype` (if given) becomes `config.dtype`; tensors stay as
    stored."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"base model directory {path} does not exist.")
    raw = read_json(path / "config.json", "base model config")
    cfg = model_config_from_hf(raw, str(path / "config.json"), dtype)
    ckpt = HFCheckpoint(path, cfg, normalize_dtype(raw.get("dtype", raw.get("torch_dtype")), str(path)),
                        _weight_map(path))
    log.info("base model %s: %s, %d layers, H=%d, V=%d, %d heads (%d kv), %s embeddings", path, cfg.architecture,
             cfg.num_hidden_layers,
             cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads, cfg.num_key_value_heads,
             "tied" if ckpt.tied else "untied")
    return ckpt

