"""Tree attention over the paged KV cache (flash-decoding style), the verify step's attention on CUDA.

Oracle: `trt_redrafter.model.attention.torch_tree_attention` (same arguments, same result up to rounding).

What it computes (see model/attention.py): request b's new token p attends to every committed position
< ctx_len[b] and to new token q where tree_mask[b, p, q]; new token q sits at KV position ctx_len[b] + q, addressed
through the block table. Unlike the PyTorch path, which gathers a fixed number of key blocks per request, each
program reads only the keys its request has (ctx_len + T).

Layout: one program per (query block, request x KV head, KV split). A query block stacks the G = nh / nkv query
heads that share a KV head over the T new tokens (rows r = t * G + g), so each K/V tile is loaded once for all of
them (GQA). The key range is cut into `num_splits` chunks so a batch-1 step still fills the GPU; each split keeps
an online softmax (running max m, sum l, weighted values acc) and the splits are merged at the end (a split with
no keys contributes nothing). K/V tiles are gathered position by position through the block table, so a tile may
cross page boundaries and any page size works.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _tree_attention_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, ctx_ptr, mask_ptr, acc_ptr, ml_ptr,
    scale,
    BS, T, NH, NKV, G, D, PAGE, NBLK, NUM_SPLITS,
    stride_qb, stride_qt, stride_qh,
    stride_ks, stride_kh,
    stride_tb,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, FP32_DOT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = pid_bh // NKV
    kvh = pid_bh % NKV

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] row = t * G + g
    t = rows // G
    h = kvh * G + rows % G
    row_ok = t < T
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D

    q = tl.load(q_ptr + b * stride_qb + t[:, None] * stride_qt + h[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]

    ctx = tl.load(ctx_ptr + b)
    total = ctx + T  # keys this request has: its context, then the new tokens
    chunk = tl.cdiv(tl.cdiv(total, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = pid_s * chunk
    end = tl.minimum(start + chunk, total)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] KV positions
        pos_ok = pos < end
        page = tl.load(table_ptr + b * stride_tb + pos // PAGE, mask=pos_ok & (pos // PAGE < NBLK), other=0)
        slot = page * PAGE + pos % PAGE
        kv_off = slot[:, None] * stride_ks + kvh * stride_kh + d[None, :]
        k = tl.load(k_ptr + kv_off, mask=pos_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        if FP32_DOT:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = (s * scale).to(tl.float32)  # [BLOCK_M, BLOCK_N] (scale may arrive as a double)
        rel = pos - ctx  # index among the new tokens
        in_tree = (rel >= 0) & (rel < T) & pos_ok
        tree = tl.load(mask_ptr + b * T * T + t[:, None] * T + rel[None, :],
                       mask=row_ok[:, None] & in_tree[None, :], other=0)
        visible = ((rel < 0) & pos_ok)[None, :] | (tree != 0)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + kv_off, mask=pos_ok[:, None] & d_ok[None, :], other=0.0)
        if FP32_DOT:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    # partial results of this split: acc [splits, b, t, h, D], (m, l) [splits, b, t, h, 2]
    out_row = ((pid_s * BS + b) * T + t) * NH + h
    tl.store(acc_ptr + out_row[:, None] * D + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(ml_ptr + out_row * 2, m_i, mask=row_ok)
    tl.store(ml_ptr + out_row * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _combine_kernel(acc_ptr, ml_ptr, out_ptr, ROWS, D, NUM_SPLITS, BLOCK_D: tl.constexpr):
    """Merge the splits' online softmaxes of one (b, t, h) row: sum_s acc_s e^(m_s - m) / sum_s l_s e^(m_s - m)."""
    row = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    m = float("-inf")
    for s in range(NUM_SPLITS):
        m = tl.maximum(m, tl.load(ml_ptr + (s * ROWS + row) * 2))
    num = tl.zeros([BLOCK_D], tl.float32)
    den = 0.0
    for s in range(NUM_SPLITS):
        w = tl.exp(tl.load(ml_ptr + (s * ROWS + row) * 2) - m)  # an empty split: exp(-inf) = 0
        den += w * tl.load(ml_ptr + (s * ROWS + row) * 2 + 1)
        num += w * tl.load(acc_ptr + (s * ROWS + row) * D + d, mask=d_ok, other=0.0)
    tl.store(out_ptr + row * D + d, (num / den).to(out_ptr.dtype.element_ty), mask=d_ok)


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(n))


def num_splits_for(bs: int, nkv: int, q_blocks: int, max_keys: int, block_n: int, device: torch.device) -> int:
    """Enough KV splits that a step has about two programs per SM (static for a given batch shape)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    want = -(-2 * sms // (bs * nkv * q_blocks))
    return max(1, min(want, -(-max_keys // block_n), 16))


def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, scale: float) -> torch.Tensor:
    """q [bs, T, nh, D]; k_cache, v_cache [num_slots, nkv, D]; meta: model.attention.AttentionMeta
    (block_table [bs, nblk], ctx_len [bs], tree_mask [bs, T, T]) -> [bs, T, nh, D] in q's dtype."""
    assert q.dim() == 4 and k_cache.dim() == 3 and v_cache.shape == k_cache.shape, \
        f"q must be [bs, T, nh, D] and caches [slots, nkv, D], got {tuple(q.shape)}, {tuple(k_cache.shape)}"
    bs, T, nh, D = q.shape
    nkv = k_cache.shape[1]
    assert k_cache.shape[2] == D and nh % nkv == 0, f"head size {D} vs cache {k_cache.shape[2]}, nh={nh} nkv={nkv}"
    assert q.dtype == k_cache.dtype == v_cache.dtype, f"dtypes differ: q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}"
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "the KV caches must be contiguous"
    table, ctx, mask = meta.block_table, meta.ctx_len, meta.tree_mask
    assert table.dim() == 2 and table.shape[0] == bs and table.stride(1) == 1, \
        f"block_table must be [bs, nblk] with unit column stride, got {tuple(table.shape)} {table.stride()}"
    assert ctx.shape == (bs,) and mask.shape == (bs, T, T) and mask.dtype == torch.bool, \
        f"ctx_len must be [bs] and tree_mask bool [bs, T, T], got {tuple(ctx.shape)}, {mask.dtype} {tuple(mask.shape)}"
    q = q.contiguous()
    mask = mask.contiguous()
    G = nh // nkv
    BLOCK_D = _pow2(D)
    BLOCK_M = _pow2(min(G * T, 64))
    BLOCK_N = 64 if BLOCK_D <= 64 else 32
    q_blocks = -(-(G * T) // BLOCK_M)
    max_keys = table.shape[1] * meta.block_size + T
    splits = num_splits_for(bs, nkv, q_blocks, max_keys, BLOCK_N, q.device)
    acc = torch.empty(splits, bs, T, nh, D, dtype=torch.float32, device=q.device)
    ml = torch.empty(splits, bs, T, nh, 2, dtype=torch.float32, device=q.device)
    grid = (q_blocks, bs * nkv, splits)
    _tree_attention_kernel[grid](
        q, k_cache, v_cache, table, ctx, mask, acc, ml, scale,
        bs, T, nh, nkv, G, D, meta.block_size, table.shape[1], splits,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), table.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, FP32_DOT=q.dtype == torch.float32)
    out = torch.empty(bs, T, nh, D, dtype=q.dtype, device=q.device)
    rows = bs * T * nh
    _combine_kernel[(rows,)](acc, ml, out, rows, D, splits, BLOCK_D=BLOCK_D)
    return out
