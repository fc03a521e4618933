"""Weight-only int8 / int4 GEMM on CUDA: y = x W^T with W = q * s read as 8 or 4 bits per weight, scaled per output
channel and group of inputs (TensorRT-LLM's W8A16 / W4A16 / W4A16_AWQ; checkpoint/quantization.py), so a decode
step streams a half or a quarter of the bytes of a bf16 weight.

Layout (made once at load, `pack`): int8 q [N, K] as is. int4 q [N, Kp / 2], Kp = K rounded up to the tiles'
`block_k` (padding weights 0): in each chunk of `block_k` inputs starting at k0, byte j of the chunk holds input
k0 + j in its low nibble and input k0 + block_k / 2 + j in its high nibble, so each nibble plane multiplies a
contiguous slice of the input. Scales [N, K / group] fp32.

Each program owns BLOCK_M rows x `block_n` outputs and walks K in `block_k` steps, one group at most per step
(`block_k` divides the group size). It loads its weight tile along K (each output channel's bytes are contiguous, so
the loads coalesce), widens the integers to the input's dtype (exact: bf16 and fp16 hold every int8 value) and
multiplies on the tensor cores with fp32 accumulation, so every product is exact; fp32 inputs multiply in IEEE fp32,
and so does every input under Triton's interpreter (its bf16 / fp16 `tl.dot` returns garbage in Triton 3.9; the
products are the same exact values).
A per-group weight's partial sums are scaled at the end of each group; a per-channel one's once, at the end. Row
tiles vary fastest in the grid, so the programs that share a weight tile run together and a verify step's many rows
read each weight from HBM about once (the L2 serves the rest).

A row's result does not depend on the rows beside it, so greedy ReDrafter == AR holds through this kernel: the
tiles are one choice per kind of weight whatever M is (`tiles_for`), and rows never meet inside a tile product.
`scripts/wo_gemm_tune.py` measures the candidates on a card.

Oracle: F.linear of the dequantized weight (`model.linear.QuantWeight.dequantize`), computed in float64.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

BLOCK_M = 16
# triton.jit reads TRITON_INTERPRET when the kernel below is defined: interpreted, it multiplies in fp32 (see above)
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


class Tiles(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# (bits, per_channel) -> tiles, for every M: the search's best on a Hopper GPU (scripts/wo_gemm_tune.py, docs/perf.md
# "The weight-only GEMM"; another architecture may want others: run the search there); int8 in groups was not
# searched and takes int8's
TILES = {
    (8, True): Tiles(32, 256, 2, 3),
    (8, False): Tiles(32, 256, 2, 3),
    (4, True): Tiles(32, 256, 4, 4),
    (4, False): Tiles(32, 128, 4, 4),
}


@triton.jit
def _wo_gemm_kernel(x_ptr, q_ptr, s_ptr, out_ptr, M, N, K, KQ, G, GROUP, INT4: tl.constexpr,
                    PER_CHANNEL: tl.constexpr, FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    # row tiles vary fastest: the programs running together share their weight tile (read from HBM once)
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if INT4:
            j = tl.arange(0, BLOCK_K // 2)
            p = tl.load(q_ptr + rn[:, None] * KQ + (k0 // 2 + j)[None, :], mask=n_ok[:, None], other=0)
            lo = (p << 4) >> 4  # sign-extended nibbles [BLOCK_N, BLOCK_K / 2]: inputs k0 + j
            hi = p >> 4  # inputs k0 + BLOCK_K / 2 + j
            ke = k0 + j
            ko = k0 + BLOCK_K // 2 + j
            xe = tl.load(x_ptr + rm[:, None] * K + ke[None, :], mask=m_ok[:, None] & (ke < K)[None, :], other=0.0)
            xo = tl.load(x_ptr + rm[:, None] * K + ko[None, :], mask=m_ok[:, None] & (ko < K)[None, :], other=0.0)
            if FP32:
                part = tl.dot(xe.to(tl.float32), tl.trans(lo.to(tl.float32)), input_precision="ieee") + \
                    tl.dot(xo.to(tl.float32), tl.trans(hi.to(tl.float32)), input_precision="ieee")
            else:
                part = tl.dot(xe, tl.trans(lo.to(xe.dtype))) + tl.dot(xo, tl.trans(hi.to(xo.dtype)))
        else:
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            w = tl.load(q_ptr + rn[:, None] * KQ + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
            x = tl.load(x_ptr + rm[:, None] * K + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            if FP32:
                part = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:
                part = tl.dot(x, tl.trans(w.to(x.dtype)))
        if PER_CHANNEL:
            acc += part
        else:
            s = tl.load(s_ptr + rn * G + k0 // GROUP, mask=n_ok, other=0.0)
            acc += part * s[None, :]
    if PER_CHANNEL:
        acc = acc * tl.load(s_ptr + rn, mask=n_ok, other=0.0)[None, :]
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def tiles_for(bits: int, group_size: int, K: int) -> Tiles:
    """The tiles for this weight, whatever the row count: the table's, with block_k halved until it divides the
    group size (a group shorter than the table's block_k, or not a multiple of it)."""
    per_channel = group_size >= K
    tiles = TILES[(bits, per_channel)]
    if not per_channel:
        bk = tiles.block_k
        while bk > 16 and group_size % bk:
            bk //= 2
        tiles = tiles._replace(block_k=bk)
    return tiles


def pack(q: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int,
         tiles: Tiles | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] int8 (int4: values in [-8, 7]) and scales [N, K / group] -> the kernel's (q, fp32 scales), for
    `tiles` (default `tiles_for`: wo_linear must be called with the same)."""
    assert q.dim() == 2 and q.dtype == torch.int8 and bits in (4, 8), (tuple(q.shape), q.dtype, bits)
    if bits == 4:
        N, K = q.shape
        bk = (tiles or tiles_for(bits, group_size, K)).block_k
        u = torch.nn.functional.pad(q, (0, -K % bk)).view(torch.uint8).reshape(N, -1, 2, bk // 2)
        q = ((u[:, :, 0] & 0xF) | ((u[:, :, 1] & 0xF) << 4)).reshape(N, -1).view(torch.int8)
    return q.contiguous(), scales.float().contiguous()


def wo_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int,
              tiles: Tiles | None = None) -> torch.Tensor:
    """x [M, K] (fp32, fp16 or bf16) times the packed weight (`pack`, with the same `tiles`) -> [M, N] in x's dtype.
    `tiles` overrides `tiles_for` (the tuning script's candidates)."""
    assert x.dim() == 2 and x.is_contiguous(), f"x must be contiguous [M, K], got {tuple(x.shape)}"
    M, K = x.shape
    N = q.shape[0]
    per_channel = group_size >= K
    t = tiles or tiles_for(bits, group_size, K)
    assert q.shape[1] == (-(-K // t.block_k) * t.block_k // 2 if bits == 4 else K), (tuple(q.shape), K, bits)
    assert per_channel or (group_size % t.block_k == 0 and t.block_k >= 16), \
        f"group size {group_size} must be a multiple of the tile's {t.block_k} inputs, at least 16 (or the whole row)"
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, t.block_n))
    _wo_gemm_kernel[grid](x, q, scales, out, M, N, K, q.shape[1], scales.shape[1], group_size,
                          INT4=bits == 4, PER_CHANNEL=per_channel, FP32=x.dtype == torch.float32 or _INTERPRETED,
                          BLOCK_M=BLOCK_M, BLOCK_N=t.block_n, BLOCK_K=t.block_k, num_warps=t.num_warps,
                          num_stages=t.num_stages)
    return out
