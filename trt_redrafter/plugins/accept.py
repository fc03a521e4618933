"""Acceptance on CUDA: the longest drafted prefix that matches the target, best beam, next token (greedy and exact),
and the counter-based draw that gives `exact` its per-node targets.

Oracles: `decoding.acceptance.accept_tokens` and `decoding.sampling.draw`. Greedy acceptance is `accept_tokens` on
the target's argmax after every tree node; exact acceptance is `accept_tokens` on one `draw` per node, so one
kernel serves both rules. One program per request; nb x bl is tiny (a few dozen tokens), so a request's whole
tree fits in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..decoding.acceptance import Acceptance


@triton.jit
def _accept_kernel(beams_ptr, node_ptr, out_ptr, NB, BL, NB_PAD: tl.constexpr, BL_PAD: tl.constexpr):
    b = tl.program_id(0)
    i = tl.arange(0, NB_PAD)[:, None]  # beam
    j = tl.arange(0, BL_PAD)[None, :]  # depth
    base = b * NB * BL + i * BL
    ok = (i < NB) & (j < BL - 1)
    drafted = tl.load(beams_ptr + base + j + 1, mask=ok, other=-1)  # beams[i, j + 1]
    target = tl.load(node_ptr + base + j, mask=ok, other=-2)  # the target's token after beams[i, :j + 1]
    miss = tl.where(ok & (drafted == target), 0, 1)
    lead = tl.sum(tl.where(tl.cumsum(miss, axis=1) == 0, 1, 0), axis=1)  # [NB_PAD] leading matches
    beam = tl.arange(0, NB_PAD)
    lead = tl.where(beam < NB, lead, -1)
    best_n = tl.max(lead, axis=0)
    best = tl.min(tl.where(lead == best_n, beam, NB_PAD), axis=0)  # first beam with the most
    nxt = tl.load(node_ptr + b * NB * BL + best * BL + best_n)
    tl.store(out_ptr + b, best)
    tl.store(out_ptr + tl.num_programs(0) + b, best_n)
    tl.store(out_ptr + 2 * tl.num_programs(0) + b, nxt)


def accept_tokens(beams: torch.Tensor, node_tokens: torch.Tensor) -> Acceptance:
    """beams, node_tokens [bs, nb, bl] int64 -> Acceptance (see decoding.acceptance.accept_tokens)."""
    assert beams.dim() == 3 and beams.dtype == torch.long and node_tokens.shape == beams.shape \
        and node_tokens.dtype == torch.long, \
        f"beams and node_tokens must be int64 [bs, nb, bl], got {beams.dtype} {tuple(beams.shape)}, " \
        f"{node_tokens.dtype} {tuple(node_tokens.shape)}"
    beams, node_tokens = beams.contiguous(), node_tokens.contiguous()
    bs, nb, bl = beams.shape
    out = torch.empty(3, bs, dtype=torch.long, device=beams.device)
    _accept_kernel[(bs,)](beams, node_tokens, out, nb, bl,
                          NB_PAD=max(2, triton.next_power_of_2(nb)), BL_PAD=max(2, triton.next_power_of_2(bl)))
    return Acceptance.unpack(out)


@triton.jit
def _mix32(x):
    """lowbias32 (decoding.sampling.mix32) on int64 holding [0, 2**32): products keep their low 32 bits."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _draw_kernel(probs_ptr, key_ptr, out_ptr, V, stride_row, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    key = tl.load(key_ptr + row)  # int64 in [0, 2**32)
    best_val = tl.full([BLOCK_V], -1.0, tl.float32)
    best_idx = tl.zeros([BLOCK_V], tl.int32)
    for v0 in range(0, V, BLOCK_V):
        v = v0 + tl.arange(0, BLOCK_V)
        ok = v < V
        p = tl.load(probs_ptr + row * stride_row + v, mask=ok, other=0.0).to(tl.float32)
        h = _mix32((key + v.to(tl.int64) * 0x9E3779B9) & 0xFFFFFFFF)
        u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # as sampling.uniform: never 1
        race = tl.where(ok, p / -tl.log(u), -1.0)
        better = race > best_val  # strict: the earliest column wins ties, as argmax
        best_idx = tl.where(better, v, best_idx)
        best_val = tl.where(better, race, best_val)
    top = tl.max(best_val, axis=0)
    idx = tl.min(tl.where(best_val == top, best_idx, V), axis=0)
    tl.store(out_ptr + row, idx.to(tl.int64))


def draw(probs: torch.Tensor, seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """probs [N, V] (float), seed/position [N] int64 -> [N] int64: decoding.sampling.draw in one pass over V."""
    from ..decoding.sampling import STREAM_TOKEN, row_keys

    assert probs.dim() == 2 and probs.stride(1) == 1 and seed.shape == position.shape == probs.shape[:1], \
        f"probs must be [N, V] with unit column stride and seed/position [N], got {tuple(probs.shape)}"
    keys = row_keys(seed, position, STREAM_TOKEN)  # [N] 32-bit keys, computed as the oracle does
    out = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    _draw_kernel[(probs.shape[0],)](probs, keys, out, probs.shape[1], probs.stride(0), BLOCK_V=1024)
    return out
