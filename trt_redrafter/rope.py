"""Rotary position embedding (GPT-NeoX layout, TensorRT-LLM `rope_gpt_neox`) with Llama's scaling variants.

`rotary_scaling` is stored the way TensorRT-LLM stores it: `{"type": "linear" | "dynamic" | "llama3", "factor": f,
...}`. Frequencies follow Hugging Face `transformers` `modeling_rope_utils` so outputs match `generate`.
"""

from __future__ import annotations

import math

import torch

from .errors import UserError

SUPPORTED_SCALING = ("linear", "dynamic", "llama3")


def validate_rotary_scaling(scaling: dict, where: str) -> None:
    if not isinstance(scaling, dict):
        raise UserError(f"{where}: expected a mapping like {{'type': 'linear', 'factor': 2.0}}, got {scaling!r}.")
    kind = scaling.get("type")
    if kind not in SUPPORTED_SCALING:
        raise UserError(f"{where}.type: expected one of {', '.join(SUPPORTED_SCALING)}, got {kind!r}.")
    factor = scaling.get("factor")
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
        raise UserError(f"{where}.factor: expected a positive number, got {factor!r}.")
    if kind == "llama3":
        for k in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if not isinstance(scaling.get(k), (int, float)):
                raise UserError(f"{where}.{k}: expected a number for llama3 scaling, got {scaling.get(k)!r}.")


def inv_freq(head_size: int, base: float, scaling: dict | None, max_position_embeddings: int,
             seq_len: int | None = None) -> torch.Tensor:
    """Inverse frequencies, float64, shape [head_size // 2]."""
    exponent = torch.arange(0, head_size, 2, dtype=torch.float64) / head_size
    kind = scaling.get("type") if scaling else None
    if kind == "dynamic" and seq_len is not None and seq_len > max_position_embeddings:
        # NTK-aware base growth, as HF `_compute_dynamic_ntk_parameters`
        f = scaling["factor"]
        base = base * ((f * seq_len / max_position_embeddings) - (f - 1)) ** (head_size / (head_size - 2))
    freq = 1.0 / (base ** exponent)
    if kind == "linear":
        freq = freq / scaling["factor"]
    elif kind == "llama3":
        f, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / lo, old_ctx / hi
        wavelen = 2 * math.pi / freq
        scaled = torch.where(wavelen > low_wavelen, freq / f, freq)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / f + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        freq = torch.where(medium, smoothed, scaled)
    return freq


class RotaryEmbedding:
    """Precomputed cos/sin tables [positions, D] (`model.llama.apply_rope` rotates with them)."""

    def __init__(self, head_size: int, base: float, scaling: dict | None, max_position_embeddings: int,
                 max_seq_len: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        freq = inv_freq(head_size, base, scaling, max_position_embeddings)
        pos = torch.arange(max_seq_len, dtype=torch.float64)
        angles = torch.outer(pos, freq)  # [S, D/2]
        emb = torch.cat([angles, angles], dim=-1)  # [S, D]
        # HF computes cos/sin in float32 then casts; we do the same so low-precision runs match it
        self.cos = emb.float().cos().to(device=device, dtype=dtype)
        self.sin = emb.float().sin().to(device=device, dtype=dtype)
