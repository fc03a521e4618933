"""Proposers: what fills the draft tree a ReDrafter step verifies. The engine takes one at construction.

Two kinds, by where they run:
    DeviceProposer  drafts from the base model's hidden state on the device, inside the compiled step
                    (`ReDrafterProposer`: the recurrent drafter's beam search).
    HostProposer    drafts on the host from each request's tokens, between steps (test oracles; learning-free
                    proposers). The engine packs what it returns into the next tree.
Both return beams [bs, nb, bl] whose column 0 is the request's true token; everything after that (pack, verify,
accept, rewind) is the same machinery.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol, runtime_checkable

import torch

from ..decoding import beam_search
from ..decoding.beam_search import BeamSearchResult, SelectFn
from ..model.drafter import DrafterRank
from .sequence import Sequence

APPLE_WARP_TOP_K = 50  # Apple's drafter keeps its 50 most likely tokens before the beam search


@runtime_checkable
class DeviceProposer(Protocol):
    num_beams: int
    draft_len: int

    def draft(self, h: torch.Tensor, true_token: torch.Tensor, keep_log_probs: bool) -> BeamSearchResult:
        """h [bs, H] (final-norm hidden state at the last accepted position), true_token [bs] -> beams."""


@runtime_checkable
class HostProposer(Protocol):
    num_beams: int
    draft_len: int

    def propose(self, seqs: list[Sequence]) -> torch.Tensor:
        """-> beams [len(seqs), nb, bl] int64 (CPU), beams[i, :, 0] == seqs[i].true_token."""


class ReDrafterProposer:
    """Apple's recurrent drafter: beam search over the drafter head, from the base model's hidden state."""

    def __init__(self, drafter: DrafterRank, embed: Callable[[torch.Tensor], torch.Tensor], num_beams: int,
                 draft_len: int, select: Optional[SelectFn] = None):
        self.drafter, self.embed = drafter, embed
        self.num_beams, self.draft_len = num_beams, draft_len
        self.warp_top_k = APPLE_WARP_TOP_K if drafter.semantics == "apple" else None
        self.select = select or beam_search.select_beams_topk

    def draft(self, h: torch.Tensor, true_token: torch.Tensor, keep_log_probs: bool) -> BeamSearchResult:
        return beam_search.beam_search(self.drafter, self.embed, h, true_token, self.num_beams, self.draft_len,
                                       warp_top_k=self.warp_top_k, keep_log_probs=keep_log_probs,
                                       select=self.select)
