"""Decoding state that lives on the device between steps: one row per batch slot.

A request gets a batch slot when it is admitted and gives it back when it finishes. Its committed KV length, its
true token (emitted, not yet in the KV cache), the packed draft tree it verifies next and its sampling parameters
stay here, on the device, so a decode step reads them with one gather by slot and writes them back with one scatter:
no per-request host work, no host-to-device copy of trees or masks. The last row is the padding slot: batch
buckets are filled with it, and whatever a step writes there is never read back.

Shapes (S = max_batch_size + 1 slots, P = max_tree_tokens = 1 + nb*dl):
    ctx_len [S]            committed KV entries
    true_tok [S]           the root of the next tree (the last emitted token)
    beams [S, nb, bl]      the drafts of the next tree (column 0 = true_tok)
    scores [S, nb, dl]     the proposer's quantized score of each beam's prefixes (step.quantize_scores)
    tree_tokens [S, P]     packed tree (decoding.tree.PackedTree, padded to P), numbered best node first
    tree_offsets [S, P]    depth of each packed token
    tree_mask [S, P, P]    ancestor-or-self mask
    unpacker [S, nb, bl]   packed index of every beam position
    draft_logp [S, nb, dl, V]  drafter log-probs of the beams (only for `apple` acceptance; allocated on first use)
    hidden [S, H]          final-norm hidden state of the token each slot's last prompt or AR step verified (only
                           when the engine records them: a drafter's distillation corpus, `Engine.load(record_hidden=True)`)
    seed, temperature, top_k, top_p, apple [S]  sampling parameters and the per-request rule
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..config import SamplingConfig
from ..decoding.tree import PackedTree


def put_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """dst[index] = src along dim 0, in place on `dst` itself (torch.compile keeps that in place; a write through a
    view of `dst` would make it copy the whole tensor). Duplicate indices (padding rows) leave one of the rows."""
    dst.index_put_((index,), src.to(dst.dtype))


@dataclass
class SlotState:
    ctx_len: torch.Tensor
    true_tok: torch.Tensor
    beams: torch.Tensor
    scores: torch.Tensor
    tree_tokens: torch.Tensor
    tree_offsets: torch.Tensor
    tree_mask: torch.Tensor
    unpacker: torch.Tensor
    seed: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    apple: torch.Tensor
    draft_logp: Optional[torch.Tensor] = None
    hidden: Optional[torch.Tensor] = None

    @classmethod
    def allocate(cls, num_slots: int, num_beams: int, draft_len: int, device: torch.device) -> "SlotState":
        nb, bl = num_beams, draft_len + 1
        P = 1 + nb * draft_len
        z = dict(device=device, dtype=torch.long)
        return cls(
            ctx_len=torch.zeros(num_slots, **z), true_tok=torch.zeros(num_slots, **z),
            beams=torch.zeros(num_slots, nb, bl, **z), scores=torch.zeros(num_slots, nb, draft_len, **z),
            tree_tokens=torch.zeros(num_slots, P, **z), tree_offsets=torch.zeros(num_slots, P, **z),
            tree_mask=torch.eye(P, dtype=torch.bool, device=device).repeat(num_slots, 1, 1),
            unpacker=torch.zeros(num_slots, nb, bl, **z),
            seed=torch.zeros(num_slots, **z),
            temperature=torch.zeros(num_slots, dtype=torch.float32, device=device),
            top_k=torch.zeros(num_slots, **z), top_p=torch.ones(num_slots, dtype=torch.float32, device=device),
            apple=torch.zeros(num_slots, dtype=torch.bool, device=device))

    @property
    def num_slots(self) -> int:
        return self.ctx_len.shape[0]

    @property
    def padding_slot(self) -> int:
        return self.num_slots - 1

    @property
    def max_tree_tokens(self) -> int:
        return self.tree_tokens.shape[1]

    def ensure_draft_logp(self, vocab_size: int) -> torch.Tensor:
        if self.draft_logp is None:
            S, nb, bl = self.beams.shape
            self.draft_logp = torch.zeros(S, nb, bl - 1, vocab_size, dtype=torch.float32, device=self.beams.device)
        return self.draft_logp

    def record_hidden(self, hidden_size: int, dtype: torch.dtype) -> None:
        """From now on prompt and AR steps write each slot's verified hidden state into `hidden`."""
        if self.hidden is None:
            self.hidden = torch.zeros(self.num_slots, hidden_size, dtype=dtype, device=self.ctx_len.device)

    def set_params(self, slots: list[int], params: list[SamplingConfig], apple: list[bool]) -> None:
        """Write admitted requests' sampling parameters and whether each takes the `apple` rule (host -> device,
        once per request)."""
        dev = self.seed.device
        idx = torch.tensor(slots, dtype=torch.long, device=dev)
        put_rows(self.seed, idx, torch.tensor([p.seed for p in params], dtype=torch.long).to(dev))
        put_rows(self.temperature, idx, torch.tensor([p.temperature for p in params]).to(dev))
        put_rows(self.top_k, idx, torch.tensor([p.top_k for p in params], dtype=torch.long).to(dev))
        put_rows(self.top_p, idx, torch.tensor([p.top_p for p in params]).to(dev))
        put_rows(self.apple, idx, torch.tensor(apple, dtype=torch.bool).to(dev))

    def store_tree(self, slots: torch.Tensor, beams: torch.Tensor, scores: torch.Tensor, tree: PackedTree,
                   log_probs: Optional[torch.Tensor] = None) -> None:
        """Make `tree` (packed from `beams` with their `scores`, padded to P) the next tree of `slots` [bs]."""
        put_rows(self.beams, slots, beams)
        put_rows(self.scores, slots, scores)
        put_rows(self.tree_tokens, slots, tree.tokens)
        put_rows(self.tree_offsets, slots, tree.position_offsets)
        put_rows(self.tree_mask, slots, tree.mask)
        put_rows(self.unpacker, slots, tree.unpacker)
        if log_probs is not None and self.draft_logp is not None:
            put_rows(self.draft_logp, slots, log_probs)

    def advance(self, slots: torch.Tensor, ctx_len: torch.Tensor, true_tok: torch.Tensor) -> None:
        """New committed KV lengths [bs] and true tokens [bs] of `slots`; the padding slot goes back to 0."""
        put_rows(self.ctx_len, slots, ctx_len)
        put_rows(self.true_tok, slots, true_tok)
        # Batch buckets are filled with the padding slot, which every step advances like a request: put it back
        # at position 0 so its addresses stay inside the block table.
        pad = torch.full((1,), self.padding_slot, dtype=torch.long, device=slots.device)
        put_rows(self.ctx_len, pad, torch.zeros(1, dtype=torch.long, device=slots.device))
