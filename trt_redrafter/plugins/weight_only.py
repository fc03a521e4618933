"""Weight-only int8 / int4 GEMM on CUDA: y = x W^T with W = q * s read as 8 or 4 bits per weight, scaled per output
channel and group of inputs (TensorRT-LLM's W8A16 / W4A16 / W4A16_AWQ; checkpoint/quantization.py), so a decode
step streams a quarter or an eighth of the bytes of an fp32 weight.

Layout (made once at load, `pack`): int8 q [N, K] as is; int4 q [N, K / 2], inputs 2j and 2j + 1 of a row in the
low and high nibble of byte j (the CPU kernel's pairing: cpu/linear.cpp). Scales [N, K / group] fp32.

Each program owns BLOCK_M rows x BLOCK_N outputs and walks K in BLOCK_K steps, one group at most per step (BLOCK_K
divides the group size): acc += (x_tile @ q_tile) * s[group], accumulated in fp32. The tile product runs on TF32
tensor cores for fp16 / bf16 inputs, where it is exact (TF32 holds every fp16, bf16 and int8 value), and in IEEE
fp32 for fp32 inputs. Every row's sum runs in one fixed order whatever M, so a row's result does not depend on the
rows beside it.

Oracle: F.linear of the dequantized weight (`model.linear.QuantWeight.dequantize`), computed in float64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32


@triton.jit
def _wo_gemm_kernel(x_ptr, q_ptr, s_ptr, out_ptr, M, N, K, G, GROUP, INT4: tl.constexpr, PRECISION: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if INT4:
            j = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # byte index: inputs 2j (low nibble) and 2j + 1 (high)
            j_ok = 2 * j < K
            p = tl.load(q_ptr + rn[None, :] * (K // 2) + j[:, None], mask=j_ok[:, None] & n_ok[None, :], other=0)
            lo = ((p << 4) >> 4).to(tl.float32)  # sign-extended nibbles [BLOCK_K / 2, BLOCK_N]
            hi = (p >> 4).to(tl.float32)
            xe = tl.load(x_ptr + rm[:, None] * K + 2 * j[None, :], mask=m_ok[:, None] & j_ok[None, :], other=0.0)
            xo = tl.load(x_ptr + rm[:, None] * K + 2 * j[None, :] + 1, mask=m_ok[:, None] & j_ok[None, :],
                         other=0.0)
            part = tl.dot(xe.to(tl.float32), lo, input_precision=PRECISION) + \
                tl.dot(xo.to(tl.float32), hi, input_precision=PRECISION)
        else:
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            q = tl.load(q_ptr + rn[None, :] * K + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0)
            x = tl.load(x_ptr + rm[:, None] * K + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            part = tl.dot(x.to(tl.float32), q.to(tl.float32), input_precision=PRECISION)
        s = tl.load(s_ptr + rn * G + k0 // GROUP, mask=n_ok, other=0.0)
        acc += part * s[None, :]
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def pack(q: torch.Tensor, scales: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] int8 (int4: values in [-8, 7]) and scales [N, K / group] -> the kernel's (q, fp32 scales)."""
    assert q.dim() == 2 and q.dtype == torch.int8 and bits in (4, 8), (tuple(q.shape), q.dtype, bits)
    if bits == 4:
        assert q.shape[1] % 2 == 0, f"int4 needs an even number of inputs, got {q.shape[1]}"
        u = q.view(torch.uint8)
        q = ((u[:, 0::2] & 0xF) | ((u[:, 1::2] & 0xF) << 4)).view(torch.int8)
    return q.contiguous(), scales.float().contiguous()


def wo_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """x [M, K] (fp32, fp16 or bf16) times the packed weight (`pack`) -> [M, N] in x's dtype."""
    assert x.dim() == 2 and x.is_contiguous(), f"x must be contiguous [M, K], got {tuple(x.shape)}"
    M, K = x.shape
    N = q.shape[0]
    assert q.shape[1] == (K // 2 if bits == 4 else K), (tuple(q.shape), K, bits)
    assert group_size % BLOCK_K == 0 or group_size >= K, \
        f"group size {group_size} must be a multiple of {BLOCK_K} (or the whole row)"
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    _wo_gemm_kernel[grid](x, q, scales, out, M, N, K, scales.shape[1], max(group_size, BLOCK_K), INT4=bits == 4,
                          PRECISION="ieee" if x.dtype == torch.float32 else "tf32", BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                          BLOCK_K=BLOCK_K)
    return out
