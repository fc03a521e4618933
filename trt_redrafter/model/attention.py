"""Per-step attention metadata: which query attends to which key, for a ragged batch of requests.

The model runs on a flat, unpadded token layout (`remove_input_padding`, as TensorRT-LLM requires for
ReDrafter): N tokens from bs requests, request-major. Attention is computed per request on a padded view
`[bs, T, ...]` (T = longest query span) against that request's keys `[bs, S, ...]` gathered from the paged cache.

Each request contributes a query span of q_len tokens placed after its ctx_len committed KV entries, with a
`[q_len, q_len]` boolean mask among the new tokens: causal for prompt processing, the tree mask for a packed
draft tree, `[[True]]` for one auto-regressive token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..runtime.kv_cache import PagedKVCache


@dataclass
class SpanSpec:
    """One request's part of a step."""

    seq_id: int
    ctx_len: int  # committed KV entries before this step
    positions: torch.Tensor  # [q_len] RoPE positions of the new tokens
    local_mask: torch.Tensor  # [q_len, q_len] bool: new token p may see new token q


@dataclass
class AttentionBatch:
    """Everything the attention layers need for one step, built once and shared by all layers."""

    positions: torch.Tensor  # [N] RoPE positions
    write_slots: torch.Tensor  # [N] cache slots the new K/V go to
    kv_slots: torch.Tensor  # [bs, S] cache slots of every key a request sees (padded with slot 0)
    q_index: torch.Tensor  # [bs, T] flat index of each padded query (padded with 0)
    unpad_index: torch.Tensor  # [N] position of each flat token in the padded [bs * T] view
    mask: torch.Tensor  # [bs, 1, T, S] bool
    q_starts: list[int]  # flat offset of each request's span
    q_lens: list[int]

    @property
    def num_tokens(self) -> int:
        return int(self.positions.numel())

    @classmethod
    def build(cls, spans: list[SpanSpec], cache: PagedKVCache) -> "AttentionBatch":
        device = cache.device
        bs = len(spans)
        q_lens = [int(s.positions.numel()) for s in spans]
        T = max(q_lens)
        S = max(s.ctx_len + q for s, q in zip(spans, q_lens))
        q_starts, off = [], 0
        for q in q_lens:
            q_starts.append(off)
            off += q
        kv_slots = torch.zeros(bs, S, dtype=torch.long, device=device)
        q_index = torch.zeros(bs, T, dtype=torch.long, device=device)
        mask = torch.zeros(bs, 1, T, S, dtype=torch.bool, device=device)
        write, unpad = [], []
        for b, (span, q, start) in enumerate(zip(spans, q_lens, q_starts)):
            total = span.ctx_len + q
            slots = cache.slots(span.seq_id, 0, total)  # [ctx + q]
            kv_slots[b, :total] = slots
            write.append(slots[span.ctx_len:])
            q_index[b, :q] = torch.arange(start, start + q, device=device)
            unpad.append(torch.arange(b * T, b * T + q, device=device))
            mask[b, 0, :q, :span.ctx_len] = True
            mask[b, 0, :q, span.ctx_len:total] = span.local_mask.to(device)
            mask[b, 0, q:, 0] = True  # padded query rows see one key so softmax stays finite; their output is dropped
        return cls(
            positions=torch.cat([s.positions for s in spans]).to(device),
            write_slots=torch.cat(write),
            kv_slots=kv_slots,
            q_index=q_index,
            unpad_index=torch.cat(unpad),
            mask=mask,
            q_starts=q_starts,
            q_lens=q_lens,
        )


def causal_mask(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril_()
