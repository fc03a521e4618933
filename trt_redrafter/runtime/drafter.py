"""The device drafter: Apple's recurrent drafter's beam search over the drafter head, from the base model's hidden
state, run inside the compiled step (scores: the drafter's log-probabilities of the beam prefixes). Proposers that
draft on the device own one (proposer.py); the step runs it (step.py)."""

from __future__ import annotations

from typing import Callable, Optional, Protocol, runtime_checkable

import torch

from ..decoding import beam_search
from ..decoding.beam_search import BeamSearchResult, SelectFn
from ..model.drafter import DrafterRank

APPLE_WARP_TOP_K = 50  # Apple's drafter keeps its 50 most likely tokens before the beam search


@runtime_checkable
class DeviceDrafter(Protocol):
    num_beams: int
    draft_len: int

    def draft(self, h: torch.Tensor, true_token: torch.Tensor, keep_log_probs: bool) -> BeamSearchResult:
        """h [bs, H] (final-norm hidden state at the last accepted position), true_token [bs] -> beams, scores."""


class BeamDrafter:
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
