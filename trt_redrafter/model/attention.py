"""Tree attention over a paged KV cache, for a batch of requests with the same number of new tokens each.

One step feeds T new tokens per request (bs requests, static shapes): a packed draft tree padded to
`max_tree_tokens`, one auto-regressive token (T = 1), or a prompt padded to the longest one. Request b has
ctx_len[b] committed KV entries; its new tokens go to KV positions ctx_len[b] .. ctx_len[b] + T - 1 (position
ctx_len + p for packed token p), and new token p sees
    * every committed position < ctx_len[b], and
    * new token q where tree_mask[b, p, q] (its ancestors and itself in a draft tree; causal for a prompt).
Padding tokens see only themselves and their K/V go to a scratch slot, so they never touch a request's cache.

KV storage is one slot array per layer, [num_slots, kv_heads, D]; position t of a request lives in slot
block_table[b, t // block_size] * block_size + t % block_size (vLLM / TensorRT-LLM paged layout). Entries of a
block table past a request's blocks point at the scratch block, so every address is valid.

Three implementations compute the same thing: `torch_tree_attention` (gather the keys, dense mask, SDPA; the oracle,
and the CPU path where the C++ kernel is not used), `cpu_tree_attention` (the C++ kernel `trt_redrafter/cpu/
attention.cpp`: reads only the keys each query row sees, in place) and the Triton kernel `plugins.tree_attention`
(CUDA; reads only the keys a request has).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F


@dataclass
class AttentionMeta:
    """Everything the attention layers need for one step; built once, shared by all layers."""

    positions: torch.Tensor  # [bs, T] long: RoPE position of each new token
    write_slots: torch.Tensor  # [bs, T] long: cache slot of each new token's K/V (padding: the scratch slot)
    block_table: torch.Tensor  # [bs, nblk] long: each request's KV blocks (past its own: the scratch block)
    ctx_len: torch.Tensor  # [bs] long: committed KV entries before this step
    tree_mask: torch.Tensor  # [bs, T, T] bool: new token p may see new token q
    block_size: int
    # prompt steps only: each request's prompt length, for the rows dynamic-NTK RoPE rotates differently
    # (`rope.RotaryEmbedding.prompt_rows`); None in decode steps, which rotate with the table rows alone
    prompt_len: Optional[torch.Tensor] = None  # [bs] long
    # torch path only: the keys each request may read, [bs, S] with S = nblk * block_size, and who sees what
    kv_slots: Optional[torch.Tensor] = None  # [bs, S] long
    visible: Optional[torch.Tensor] = None  # [bs, 1, T, S] bool

    @property
    def batch_size(self) -> int:
        return self.positions.shape[0]

    def for_torch(self) -> "AttentionMeta":
        """Fill `kv_slots` and `visible` for `torch_tree_attention` (tensor ops only, no host sync)."""
        bs, T = self.positions.shape
        S = self.block_table.shape[1] * self.block_size
        dev = self.block_table.device
        kpos = torch.arange(S, device=dev)  # [S]
        kv_slots = self.block_table[:, kpos // self.block_size] * self.block_size + kpos % self.block_size  # [bs, S]
        rel = kpos[None, :] - self.ctx_len[:, None]  # [bs, S] index among the new tokens
        in_tree = (rel >= 0) & (rel < T)  # [bs, S]
        tree_vis = self.tree_mask.gather(2, rel.clamp(0, T - 1)[:, None, :].expand(bs, T, S))  # [bs, T, S]
        visible = (rel < 0)[:, None, :] | (tree_vis & in_tree[:, None, :])  # [bs, T, S]
        self.kv_slots, self.visible = kv_slots, visible[:, None]
        return self


# Extra query rows (copies of the first) every torch attention call carries. The CPU SDPA kernel multiplies a
# block of queries by the keys in one GEMM, and with 1-3 query rows that GEMM reduces in another order than with 4 or
# more (fp32: every row's bits; bf16 with grouped-query attention: now and then), so an AR step's token would get
# other bits than the same token at the root of a draft tree. With the copies every call has >= 4 rows; appended
# always rather than "up to 4" so that a compiled step need not branch on the tree width.
PAD_QUERY_ROWS = 3


def _padded_rows(x: torch.Tensor) -> torch.Tensor:
    """x [bs, heads, T, ...] with PAD_QUERY_ROWS copies of its first row appended along dim 2."""
    return torch.cat([x, x[:, :, :1].expand(-1, -1, PAD_QUERY_ROWS, -1)], dim=2)


def torch_tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMeta,
                         scale: float) -> torch.Tensor:
    """q [bs, T, nh, D]; caches [num_slots, kvh, D] (this step's K/V already written) -> out [bs, T, nh, D]."""
    assert meta.kv_slots is not None and meta.visible is not None, "call meta.for_torch() first"
    T, nh, nkv = q.shape[1], q.shape[2], k_cache.shape[1]
    bs, S = meta.kv_slots.shape
    # index_select, not k_cache[kv_slots]: the same rows, copied whole where advanced indexing gathers element by
    # element (several times slower on the CPU at every context length)
    flat = meta.kv_slots.reshape(bs * S)
    keys = k_cache.index_select(0, flat).view(bs, S, nkv, -1).transpose(1, 2)  # [bs, nkv, S, D]
    vals = v_cache.index_select(0, flat).view(bs, S, nkv, -1).transpose(1, 2)
    # T >= 1 always; said so for a compiled tree step, whose width is an unbacked size (runtime/graphs.py
    # `mark_width`): without it the copies' source slice [:1] has the size min(1, T) and will not expand
    torch._check(T >= 1)
    qt = _padded_rows(q.transpose(1, 2))  # [bs, nh, T + pad, D]
    # the mask has T rows; expanded to q's T, which compiled TP steps need: split at the ranks' collectives, a graph
    # piece can receive the two as separate inputs, the mask's rows specialized at 1 and q's symbolic
    visible = _padded_rows(meta.visible.expand(-1, -1, T, -1))  # [bs, 1, T + pad, S]
    out = F.scaled_dot_product_attention(qt, keys, vals, attn_mask=visible, scale=scale,
                                         enable_gqa=nh != nkv)  # [bs, nh, T + pad, D]
    return out[:, :, :T].transpose(1, 2)


def cpu_tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMeta,
                       scale: float) -> torch.Tensor:
    """`torch_tree_attention`'s contract on the CPU kernel (trt_redrafter/cpu/attention.cpp; `cpu.ops()` loaded it):
    every output row computed in one order whatever the number of new tokens, so no extra query rows."""
    return torch.ops.trt_redrafter_cpu.tree_attention(q, k_cache, v_cache, meta.block_table, meta.ctx_len,
                                                      meta.tree_mask, meta.block_size, scale)


def causal_mask(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril_()
