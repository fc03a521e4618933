"""Weight-only int8 / int4 GEMM on CUDA: y = x W^T with W = q * s read as 8 or 4 bits per weight, scaled per output
channel and group of inputs (TensorRT-LLM's W8A16 / W4A16 / W4A16_AWQ; checkpoint/quantization.py), so a decode
step streams a half or a quarter of the bytes of a bf16 weight.

Layout (made once at load, `pack`): int8 q [N, K] as is. int4 q [N, Kp / 2], Kp = K rounded up to the tiles'
`block_k` (padding weights 0): in each chunk of `block_k` inputs starting at k0, byte j of the chunk holds input
k0 + j in its low nibble and input k0 + block_k / 2 + j in its high nibble, so each nibble plane multiplies a
contiguous slice of the input. Scales [N, K / group] fp32.

Each program owns 1, 2 or 4 row tiles of BLOCK_M rows (as many as M fills, as its tiles allow: `row_tiles_for`) x
`block_n` outputs and walks K in `block_k` steps, one group at most per step (`block_k` divides the group size). It
loads its weight tile once per step for all its row tiles (with one row tile per program, a batch's verify step of
200 rows loaded and widened each tile 13 times), along K (each output channel's bytes are contiguous, so the loads
coalesce), widens the integers to the input's dtype (exact: bf16 and fp16 hold every int8 value) and
multiplies on the tensor cores with fp32 accumulation, so every product is exact; fp32 inputs multiply in IEEE fp32,
and so does every input under Triton's interpreter (its bf16 / fp16 `tl.dot` returns garbage in Triton 3.9; the
products are the same exact values).
A per-group weight's partial sums are scaled at the end of each group; a per-channel one's once, at the end. Row
tiles vary fastest in the grid, so the programs that share a weight tile run together and a verify step's many rows
read each weight from HBM about once (the L2 serves the rest).

A row's result does not depend on the rows beside it, so greedy ReDrafter == AR holds through this kernel: the
tiles are one choice per kind of weight whatever M is (`tiles_for`), rows never meet inside a tile product, and
every row tile, whichever program and position it has, is the same tl.dot of BLOCK_M rows in the same K order.
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
MAX_ROW_TILES = 4  # row tiles a program may take, at most, whatever its tiles say (1, 2 or 4)
# triton.jit reads TRITON_INTERPRET when the kernel below is defined: interpreted, it multiplies in fp32 (see above)
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


class Tiles(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    max_row_tiles: int = 1  # row tiles a program may take (1, 2 or 4; `row_tiles_for`)
    row_tiles_from: int = 17  # from this many rows M on


# (bits, per_channel) -> tiles, for every M: the search's best on a Hopper GPU (scripts/wo_gemm_tune.py, docs/perf.md
# "The weight-only GEMM"; another architecture may want others: run the search there); int8 in groups was not
# searched and takes int8's. Row tiles per program from `wo_gemm_tune.py --row-tiles 1,2,4` on an H200 (a 7B model's
# four layers, summed): int4 took 2 at 25 rows (0.19 against 0.25 ms) and 4 at 200 (0.83 against 1.39); int8, on
# 2 warps, lost at 25 rows with 2 (0.149 against 0.138) and won at 200 with 2 (0.58 against 0.63), not with 4 (0.80)
TILES = {
    (8, True): Tiles(32, 256, 2, 3, max_row_tiles=2, row_tiles_from=65),
    (8, False): Tiles(32, 256, 2, 3, max_row_tiles=2, row_tiles_from=65),
    (4, True): Tiles(32, 256, 4, 4, max_row_tiles=4),
    (4, False): Tiles(32, 128, 4, 4, max_row_tiles=4),
}


@triton.jit
def _tile_dot(x_ptr, rm, m_ok, K, k0, a, b, INT4: tl.constexpr, FP32: tl.constexpr, BLOCK_K: tl.constexpr):
    """One row tile's product with the weight tile of this K step: a = the weight tile widened to the input's dtype
    and transposed [BLOCK_K, BLOCK_N] (int4: the low nibbles' [BLOCK_K / 2, BLOCK_N], b the high ones')."""
    if INT4:
        j = tl.arange(0, BLOCK_K // 2)
        ke = k0 + j  # inputs of the low nibbles
        ko = k0 + BLOCK_K // 2 + j  # of the high ones
        xe = tl.load(x_ptr + rm[:, None] * K + ke[None, :], mask=m_ok[:, None] & (ke < K)[None, :], other=0.0)
        xo = tl.load(x_ptr + rm[:, None] * K + ko[None, :], mask=m_ok[:, None] & (ko < K)[None, :], other=0.0)
        if FP32:
            part = tl.dot(xe.to(tl.float32), a, input_precision="ieee") + \
                tl.dot(xo.to(tl.float32), b, input_precision="ieee")
        else:
            part = tl.dot(xe, a) + tl.dot(xo, b)
    else:
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * K + k[None, :], mask=m_ok[:, None] & (k < K)[None, :], other=0.0)
        if FP32:
            part = tl.dot(x.to(tl.float32), a, input_precision="ieee")
        else:
            part = tl.dot(x, a)
    return part


@triton.jit
def _store_tile(out_ptr, acc, rm, rn, M, N, s_ptr, PER_CHANNEL: tl.constexpr):
    if PER_CHANNEL:
        acc = acc * tl.load(s_ptr + rn, mask=rn < N, other=0.0)[None, :]
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rm < M)[:, None] & (rn < N)[None, :])


@triton.jit
def _wo_gemm_kernel(x_ptr, q_ptr, s_ptr, out_ptr, M, N, K, KQ, G, GROUP, INT4: tl.constexpr,
                    PER_CHANNEL: tl.constexpr, FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, ROW_TILES: tl.constexpr):
    # ROW_TILES row tiles of BLOCK_M rows per program (1, 2 or 4): each K step's weight tile is loaded and widened
    # once for all of them, and each row tile multiplies it by the same tl.dot of the same shape, in the same K order,
    # as alone; row tiles vary fastest in the grid, so the programs running together share their weight tile
    r0 = tl.program_id(0) * (BLOCK_M * ROW_TILES) + tl.arange(0, BLOCK_M)
    r1 = r0 + BLOCK_M
    r2 = r0 + 2 * BLOCK_M
    r3 = r0 + 3 * BLOCK_M
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    acc0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    dt = tl.float32 if FP32 else x_ptr.dtype.element_ty
    for k0 in range(0, K, BLOCK_K):
        if INT4:
            j = tl.arange(0, BLOCK_K // 2)
            p = tl.load(q_ptr + rn[:, None] * KQ + (k0 // 2 + j)[None, :], mask=n_ok[:, None], other=0)
            a = tl.trans(((p << 4) >> 4).to(dt))  # sign-extended low nibbles: inputs k0 + j
            b = tl.trans((p >> 4).to(dt))  # inputs k0 + BLOCK_K / 2 + j
        else:
            k = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(q_ptr + rn[:, None] * KQ + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0)
            a = tl.trans(w.to(dt))
            b = a
        if PER_CHANNEL:
            acc0 += _tile_dot(x_ptr, r0, r0 < M, K, k0, a, b, INT4, FP32, BLOCK_K)
            if ROW_TILES > 1:
                acc1 += _tile_dot(x_ptr, r1, r1 < M, K, k0, a, b, INT4, FP32, BLOCK_K)
            if ROW_TILES > 2:
                acc2 += _tile_dot(x_ptr, r2, r2 < M, K, k0, a, b, INT4, FP32, BLOCK_K)
                acc3 += _tile_dot(x_ptr, r3, r3 < M, K, k0, a, b, INT4, FP32, BLOCK_K)
        else:
            s = tl.load(s_ptr + rn * G + k0 // GROUP, mask=n_ok, other=0.0)[None, :]
            acc0 += _tile_dot(x_ptr, r0, r0 < M, K, k0, a, b, INT4, FP32, BLOCK_K) * s
            if ROW_TILES > 1:
                acc1 += _tile_dot(x_ptr, r1, r1 < M, K, k0, a, b, INT4, FP32, BLOCK_K) * s
            if ROW_TILES > 2:
                acc2 += _tile_dot(x_ptr, r2, r2 < M, K, k0, a, b, INT4, FP32, BLOCK_K) * s
                acc3 += _tile_dot(x_ptr, r3, r3 < M, K, k0, a, b, INT4, FP32, BLOCK_K) * s
    _store_tile(out_ptr, acc0, r0, rn, M, N, s_ptr, PER_CHANNEL)
    if ROW_TILES > 1:
        _store_tile(out_ptr, acc1, r1, rn, M, N, s_ptr, PER_CHANNEL)
    if ROW_TILES > 2:
        _store_tile(out_ptr, acc2, r2, rn, M, N, s_ptr, PER_CHANNEL)
        _store_tile(out_ptr, acc3, r3, rn, M, N, s_ptr, PER_CHANNEL)


def row_tiles_for(M: int, tiles: Tiles) -> int:
    """Row tiles per program for an M-row call with these tiles: 1 below `tiles.row_tiles_from` rows, else as many as
    M fills (1, 2 or 4), up to `tiles.max_row_tiles` and MAX_ROW_TILES."""
    most = min(tiles.max_row_tiles, MAX_ROW_TILES)
    need = -(-M // BLOCK_M)
    if M < tiles.row_tiles_from or need <= 1 or most < 2:
        return 1
    return 2 if need == 2 or most < 4 else 4


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
              tiles: Tiles | None = None, row_tiles: int | None = None) -> torch.Tensor:
    """x [M, K] (fp32, fp16 or bf16) times the packed weight (`pack`, with the same `tiles`) -> [M, N] in x's dtype.
    `tiles` overrides `tiles_for` (the tuning script's candidates), `row_tiles` `row_tiles_for` (1, 2 or 4)."""
    assert x.dim() == 2 and x.is_contiguous(), f"x must be contiguous [M, K], got {tuple(x.shape)}"
    M, K = x.shape
    N = q.shape[0]
    per_channel = group_size >= K
    t = tiles or tiles_for(bits, group_size, K)
    assert q.shape[1] == (-(-K // t.block_k) * t.block_k // 2 if bits == 4 else K), (tuple(q.shape), K, bits)
    assert per_channel or (group_size % t.block_k == 0 and t.block_k >= 16), \
        f"group size {group_size} must be a multiple of the tile's {t.block_k} inputs, at least 16 (or the whole row)"
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    rows = row_tiles or row_tiles_for(M, t)
    assert rows in (1, 2, 4), rows
    grid = (triton.cdiv(M, BLOCK_M * rows), triton.cdiv(N, t.block_n))
    _wo_gemm_kernel[grid](x, q, scales, out, M, N, K, q.shape[1], scales.shape[1], group_size,
                          INT4=bits == 4, PER_CHANNEL=per_channel, FP32=x.dtype == torch.float32 or _INTERPRETED,
                          BLOCK_M=BLOCK_M, BLOCK_N=t.block_n, BLOCK_K=t.block_k, ROW_TILES=rows,
                          num_warps=t.num_warps, num_stages=t.num_stages)
    return out
