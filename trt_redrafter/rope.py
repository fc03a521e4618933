"""Rotary position embedding (GPT-NeoX layout, TensorRT-LLM `rope_gpt_neox`) with Llama's scaling variants.

`rotary_scaling` is stored the way TensorRT-LLM stores it: `{"type": "linear" | "dynamic" | "llama3", "factor": f,
...}`. Frequencies follow Hugging Face `transformers` `modeling_rope_utils` so outputs match `generate`.

Dynamic NTK scaling ("dynamic") depends on the sequence length, the way Hugging Face applies it
(`dynamic_rope_update` on `LlamaRotaryEmbedding.forward`): every forward recomputes the frequencies for
seq_len = max(position) + 1 once that exceeds what it last used, and K/V already in the cache keep the rotation they
were computed with. One `generate` call therefore rotates
    the prompt (one forward of L tokens)            with freq(max(L, orig))
    a generated token at position p (one per step)  with freq(max(p + 1, orig))
(orig = max_position_embeddings). Both are "the token at position p of a request with an L-token prompt rotates
with freq(max(p + 1, L, orig))", and that is what the runtime computes: the table row p holds the generated-token
rotation (so a draft-tree node at p rotates exactly as AR rotates that position), and a prompt step asks
`RotaryEmbedding.prompt_rows` for its rows.
"""

from __future__ import annotations

import math
from typing import Optional

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
    kind = scaling.get("type") if scaling else None
    if kind == "dynamic" and seq_len is not None:
        lens = torch.tensor([seq_len], dtype=torch.float64)
        return dynamic_inv_freq(head_size, base, scaling["factor"], max_position_embeddings, lens)[0]
    exponent = torch.arange(0, head_size, 2, dtype=torch.float64) / head_size
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


def dynamic_inv_freq(head_size: int, base: float, factor: float, max_position_embeddings: int,
                     seq_len: torch.Tensor) -> torch.Tensor:
    """Dynamic-NTK inverse frequencies for each sequence length: seq_len [n] -> float64 [n, head_size // 2].

    NTK-aware base growth, as HF `_compute_dynamic_ntk_parameters` (credit: /u/bloc97 and /u/emozilla):
    base' = base * (factor * s / orig - (factor - 1)) ** (D / (D - 2)) for s = seq_len > orig; the plain
    frequencies where s <= orig (exactly, as HF keeps its original `inv_freq` there).
    """
    orig = max_position_embeddings
    exponent = torch.arange(0, head_size, 2, dtype=torch.float64, device=seq_len.device) / head_size  # [D/2]
    s = seq_len.to(torch.float64)[:, None]  # [n, 1]
    grown = base * ((factor * s / orig) - (factor - 1)) ** (head_size / (head_size - 2))  # [n, 1]
    bases = torch.where(s > orig, grown, torch.full_like(grown, base))  # [n, 1]
    return 1.0 / (bases ** exponent)  # [n, D/2]


def _cos_sin(angles: torch.Tensor, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """angles [..., D/2] float64 -> (cos, sin) [..., D] in `dtype` on `device`."""
    emb = torch.cat([angles, angles], dim=-1)  # [..., D]
    # HF computes cos/sin in float32 then casts; we do the same so low-precision runs match it
    return emb.float().cos().to(device=device, dtype=dtype), emb.float().sin().to(device=device, dtype=dtype)


class RotaryEmbedding:
    """Precomputed cos/sin tables [positions, D] (`model.llama.apply_rope` rotates with them).

    With dynamic scaling (`dynamic`), row p rotates with freq(max(p + 1, orig)): what an AR step gives position p
    (module docstring); prompt steps take their rows from `prompt_rows`.
    """

    def __init__(self, head_size: int, base: float, scaling: dict | None, max_position_embeddings: int,
                 max_seq_len: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        self.head_size, self.base, self.max_position_embeddings = head_size, base, max_position_embeddings
        self.dynamic = bool(scaling) and scaling.get("type") == "dynamic"
        self.factor = scaling["factor"] if self.dynamic else None
        pos = torch.arange(max_seq_len, dtype=torch.float64)  # [S]
        if self.dynamic:
            angles = pos[:, None] * self._freq(pos + 1)  # [S, D/2]
        else:
            angles = torch.outer(pos, inv_freq(head_size, base, scaling, max_position_embeddings))  # [S, D/2]
        self.cos, self.sin = _cos_sin(angles, device, dtype)  # [S, D] each

    def _freq(self, seq_len: torch.Tensor) -> torch.Tensor:
        """seq_len [n] -> dynamic-NTK inverse frequencies [n, D/2] float64."""
        return dynamic_inv_freq(self.head_size, self.base, self.factor, self.max_position_embeddings, seq_len)

    def prompt_rows(self, positions: torch.Tensor, prompt_len: torch.Tensor
                    ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """cos/sin rows of a prompt step that differ from the table, else None (only dynamic scaling differs).

        positions [bs, T] long, prompt_len [bs] long (the request's prompt length L) -> (cos, sin) [bs * T, D]: the
        token at position p rotates with freq(max(p + 1, L, orig)). So a prompt longer than orig rotates with freq(L)
        as HF's one prompt forward does, and tokens past L (a preempted request recomputing its output) rotate as
        the AR steps that made them did. Rows that need no override are the table's own, bit for bit.
        """
        if not self.dynamic:
            return None
        bs, T = positions.shape
        pos = positions.reshape(bs * T)  # [N]
        cos, sin = self.cos[pos], self.sin[pos]  # [N, D]
        L = prompt_len[:, None].expand(bs, T).reshape(bs * T)  # [N]
        over = (pos < L) & (L > self.max_position_embeddings)  # [N] prompt tokens of a prompt longer than orig
        p = pos.to(torch.float64)
        angles = p[:, None] * self._freq(torch.maximum(p + 1, L.to(torch.float64)))  # [N, D/2]
        c, s = _cos_sin(angles, cos.device, cos.dtype)
        return torch.where(over[:, None], c, cos), torch.where(over[:, None], s, sin)
