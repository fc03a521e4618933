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

    def draft(self, h: torch.Tensor, true_token: torch.Tensor, keep_log_probs: bool,
              beams: Optional[torch.Tensor] = None) -> BeamSearchResult:
        """h [bs, H] (final-norm hidden state at the last accepted position), true_token [bs] -> beams, scores;
        `beams` [k]: search k <= num_beams beams (None: num_beams). A tensor whose length counts, not an int: in a
        compiled step k is an unbacked size, which stays one where the step's graph breaks around this call."""


class BeamDrafter:
    """Apple's recurrent drafter: beam search over the drafter head, from the base model's hidden state."""

    def __init__(self, drafter: DrafterRank, embed: Callable[[torch.Tensor], torch.Tensor], num_beams: int,
                 draft_len: int, select: Optional[SelectFn] = None):
        self.drafter, self.embed = drafter, embed
        self.num_beams, self.draft_len = num_beams, draft_len
        self.warp_top_k = APPLE_WARP_TOP_K if drafter.semantics == "apple" else None
        self.select = select or beam_search.select_beams_topk

    def draft(self, h: torch.Tensor, true_token: torch.Tensor, keep_log_probs: bool,
              beams: Optional[torch.Tensor] = None) -> BeamSearchResult:
        nb = self.num_beams if beams is None else beams.shape[0]
        # traced (the count an unbacked size): choose every path by the bound, never by the count
        bound = self.num_beams if beams is not None and torch.compiler.is_compiling() else None
        return beam_search.beam_search(self.drafter, self.embed, h, true_token, nb, self.draft_len,
                                       warp_top_k=self.warp_top_k, keep_log_probs=keep_log_probs,
                                       select=self.select, max_beams=bound)
