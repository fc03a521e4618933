"""Fused elementwise kernels for the decoder layer on CUDA: one launch where PyTorch runs five to twelve.

At batch 1 a 7B step is 4 weight-streaming GEMMs per layer plus dozens of tiny elementwise kernels (RMSNorm is
~7, RoPE ~12, the SiLU gate 3); each costs a launch slot of a few microseconds even inside a CUDA graph, and with
the GEMMs weight-bound and short at batch 1 those slots are a real share of the step. These kernels do the same
arithmetic in one pass, rounding to the model dtype at the same points as the PyTorch ops (Hugging Face's order,
round to nearest even, done on the bits for bf16 so no cast can round differently). Products and sums are exact
IEEE float32 on both sides, so RoPE and the residual add match PyTorch bit for bit; the normalization's reduction
order and SiLU's exp may differ in the last float32 bit, hence one bf16 ulp at most (the tests' tolerances).

Oracles: `model.llama.TorchLayerOps` (add_rms_norm, rope_write_kv, silu_mul).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _round(x, DT: tl.constexpr):
    """Round float32 `x` to the model dtype and back, as PyTorch rounds an op's result (round to nearest even).

    bf16 is rounded with integer arithmetic on the bits: the value is then exact in bf16, so the final store's
    conversion cannot round it again differently (Triton's interpreter truncates where a GPU rounds, so a plain cast
    can differ by one ulp between them). NaN/inf are not special-cased (none reach here).
    """
    if DT == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    elif DT == tl.float32:
        return x
    else:
        return x.to(DT).to(tl.float32)


@triton.jit
def _add_rms_norm_kernel(res_ptr, delta_ptr, w_ptr, out_ptr, H, eps, HAS_DELTA: tl.constexpr,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    ok = c < H
    x = tl.load(res_ptr + row * H + c, mask=ok, other=0.0)
    dt = x.dtype
    xf = x.to(tl.float32)
    if HAS_DELTA:  # residual += delta, rounded to the model dtype (a PyTorch add)
        xf = _round(xf + tl.load(delta_ptr + row * H + c, mask=ok, other=0.0).to(tl.float32), dt)
        tl.store(res_ptr + row * H + c, xf.to(dt), mask=ok)
    var = tl.sum(xf * xf, axis=0) / H
    y = _round(xf * (1.0 / tl.sqrt(var + eps)), dt)  # Hugging Face: normalize in fp32, cast, then scale
    w = tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * H + c, _round(w * y, dt).to(dt), mask=ok)


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual [N, H] (updated in place to residual + delta when delta is given), weight [H] ->
    (residual, rms_norm(residual) * weight)."""
    assert residual.dim() == 2 and residual.is_contiguous() and weight.shape == residual.shape[1:], \
        f"residual must be contiguous [N, H] and weight [H], got {tuple(residual.shape)}, {tuple(weight.shape)}"
    assert delta is None or (delta.shape == residual.shape and delta.dtype == residual.dtype), \
        f"delta must match residual {tuple(residual.shape)} {residual.dtype}"
    N, H = residual.shape
    out = torch.empty_like(residual)
    d = residual if delta is None else delta.contiguous()
    _add_rms_norm_kernel[(N,)](residual, d, weight, out, H, eps, HAS_DELTA=delta is not None,
                               BLOCK=triton.next_power_of_2(H))
    return residual, out


@triton.jit
def _rope_kv_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                    NH, NKV, D, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    tok = tl.program_id(0)
    head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1] over nh + nkv heads
    c = tl.arange(0, HALF)[None, :]
    is_q = head < NH
    is_k = (head >= NH) & (head < NH + NKV)
    width = (NH + 2 * NKV) * D
    pos = tl.load(pos_ptr + tok)
    cos1 = tl.load(cos_ptr + pos * 2 * HALF + c).to(tl.float32)
    cos2 = tl.load(cos_ptr + pos * 2 * HALF + HALF + c).to(tl.float32)
    sin1 = tl.load(sin_ptr + pos * 2 * HALF + c).to(tl.float32)
    sin2 = tl.load(sin_ptr + pos * 2 * HALF + HALF + c).to(tl.float32)
    rot = is_q | is_k
    x1 = tl.load(qkv_ptr + tok * width + head * D + c, mask=rot, other=0.0)
    x2 = tl.load(qkv_ptr + tok * width + head * D + HALF + c, mask=rot, other=0.0)
    dt = x1.dtype
    # x * cos + rotate_half(x) * sin, each product and the sum rounded as PyTorch rounds them
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    o1 = _round(_round(f1 * cos1, dt) + _round(-f2 * sin1, dt), dt).to(dt)
    o2 = _round(_round(f2 * cos2, dt) + _round(f1 * sin2, dt), dt).to(dt)
    tl.store(q_out_ptr + tok * NH * D + head * D + c, o1, mask=is_q)
    tl.store(q_out_ptr + tok * NH * D + head * D + HALF + c, o2, mask=is_q)
    slot = tl.load(slot_ptr + tok)
    kh = head - NH
    tl.store(k_cache_ptr + slot * NKV * D + kh * D + c, o1, mask=is_k)
    tl.store(k_cache_ptr + slot * NKV * D + kh * D + HALF + c, o2, mask=is_k)
    is_v = (head >= NH + NKV) & (head < NH + 2 * NKV)
    v1 = tl.load(qkv_ptr + tok * width + head * D + c, mask=is_v, other=0.0)
    v2 = tl.load(qkv_ptr + tok * width + head * D + HALF + c, mask=is_v, other=0.0)
    vh = head - NH - NKV
    tl.store(v_cache_ptr + slot * NKV * D + vh * D + c, v1, mask=is_v)
    tl.store(v_cache_ptr + slot * NKV * D + vh * D + HALF + c, v2, mask=is_v)


def rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, nh: int,
                  nkv: int, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """qkv [N, (nh + 2 nkv) D] -> rotated q [N, nh, D]; rotated k and v go to cache rows `slots` [N]."""
    N, width = qkv.shape
    D = k_cache.shape[-1]
    assert qkv.is_contiguous() and width == (nh + 2 * nkv) * D and D % 2 == 0, \
        f"qkv must be contiguous [N, (nh + 2 nkv) D] = [N, {(nh + 2 * nkv) * D}], got {tuple(qkv.shape)}"
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[1] == nkv, "caches [slots, nkv, D]"
    assert cos.shape[-1] == D and cos.is_contiguous() and sin.is_contiguous(), "cos/sin tables [positions, D]"
    assert (D // 2) & (D // 2 - 1) == 0, f"head size {D}: the fused RoPE kernel needs D/2 a power of two"
    q = torch.empty(N, nh, D, dtype=qkv.dtype, device=qkv.device)
    heads = nh + 2 * nkv
    block_h = min(16, triton.next_power_of_2(heads))
    _rope_kv_kernel[(N, triton.cdiv(heads, block_h))](qkv, positions.contiguous(), cos, sin, q, k_cache, v_cache,
                                                      slots.contiguous(), nh, nkv, D, HALF=D // 2, BLOCK_H=block_h)
    return q


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, INNER, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < INNER
    g = tl.load(gu_ptr + row * 2 * INNER + c, mask=ok, other=0.0)
    u = tl.load(gu_ptr + row * 2 * INNER + INNER + c, mask=ok, other=0.0)
    gf = g.to(tl.float32)
    s = _round(gf / (1.0 + tl.exp(-gf)), g.dtype)  # F.silu, rounded to the dtype
    tl.store(out_ptr + row * INNER + c, _round(s * u.to(tl.float32), g.dtype).to(g.dtype), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [N, 2 I] (gate rows, then up rows: model.llama.MLP's fc_gate) -> silu(gate) * up [N, I]."""
    assert gate_up.dim() == 2 and gate_up.is_contiguous() and gate_up.shape[1] % 2 == 0, \
        f"gate_up must be contiguous [N, 2 I], got {tuple(gate_up.shape)}"
    N, two_i = gate_up.shape
    out = torch.empty(N, two_i // 2, dtype=gate_up.dtype, device=gate_up.device)
    _silu_mul_kernel[(N, triton.cdiv(two_i // 2, 1024))](gate_up, out, two_i // 2, BLOCK=1024)
    return out
