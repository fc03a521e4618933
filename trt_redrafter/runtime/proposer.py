"""Proposers: what fills a speculative request's draft tree, with a score (log-confidence) for every node.

Every proposer answers the same question, "which drafts, and how sure are you of each?", and every tree it proposes
goes through the one speculation policy (policy.py), which verifies as much of it as pays for itself. A tree is nb
beams of bl tokens (column 0 the request's true token) and, per beam, the scores of its prefixes (quantized
log-probabilities, step.quantize_scores): the score of a node is the proposer's confidence in the whole path to it.

    BeamDrafter        the recurrent drafter's beam search on the device, inside the compiled step (scores: the
                       drafter's log-probabilities of the beam prefixes)
    Proposer           the interface the engine asks, one object per name in config.PROPOSERS:
        ReDrafterProposer  the device drafter's trees as they are
        NgramProposer      (ngram.py) trees composed on the host from the request's context and the base's bigrams
        MixedProposer      the device drafter's beams with context N-gram matches in place of its lowest-ranked ones
Tests pass their own Proposer to the engine (oracles that know the continuation) and it drafts every request.

A proposer says where its trees come from (`on_device`: the step drafts them; `on_host`: `compose` makes them between
steps, packed at the start of the next step), and whether the `apple` acceptance rule can use them
(`drafter_probabilities`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Optional, Protocol, runtime_checkable

import torch

from ..decoding import beam_search
from ..decoding.beam_search import BeamSearchResult, SelectFn
from ..model.drafter import DrafterRank
from .sequence import Sequence

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


@dataclass
class Draft:
    """A tree as nb beams: rows [nb][bl] (column 0 the true token) and scores [nb][dl] (quantized log-confidence of
    each row's prefix up to each drafted token)."""

    rows: list[list[int]]
    scores: list[list[int]]

    def nodes(self) -> tuple[list[int], list[int]]:
        """(scores, depths) of the packed tree's nodes, best first as the step numbers them (root first): each
        distinct prefix once, scored by its first row and never above its parent (`tree.node_scores`)."""
        seen: dict[tuple[int, ...], int] = {}
        for row, sc in zip(self.rows, self.scores):
            parent = 0
            for j in range(1, len(row)):
                key = tuple(row[1:j + 1])
                if key not in seen:
                    seen[key] = min(sc[j - 1], parent)
                parent = seen[key]
        nodes = sorted(((s, len(k)) for k, s in seen.items()), key=lambda x: (-x[0], x[1]))
        return [0] + [s for s, _ in nodes], [0] + [d for _, d in nodes]

    @classmethod
    def of_flat(cls, beams: list[int], scores: list[int], nb: int) -> "Draft":
        bl, dl = len(beams) // nb, len(scores) // nb
        return cls([beams[i * bl:(i + 1) * bl] for i in range(nb)], [scores[i * dl:(i + 1) * dl] for i in range(nb)])


class Proposer:
    """What fills the trees of the requests that name it. Subclasses set the class attributes and, if they compose
    on the host, `compose`."""

    name: ClassVar[str] = ""
    on_device: ClassVar[bool] = False  # the step drafts its next tree with the engine's device drafter
    on_host: ClassVar[bool] = False  # `compose` makes its next tree on the host between steps
    wants_device_beams: ClassVar[bool] = False  # `compose` starts from the device's beams (read back with the step)
    drafter_probabilities: ClassVar[bool] = False  # its trees carry the drafter's distributions (`apple` rule)

    def compose(self, seq: Sequence, device: Optional[Draft]) -> Optional[Draft]:
        """The next tree of `seq` (after its last step: seq.true_token is the root), from the device's draft where
        `wants_device_beams` and the step drafted. None: keep the tree the step packed (on_device), or nothing to
        verify (the policy then has no tree for this request)."""
        return None


class ReDrafterProposer(Proposer):
    name = "redrafter"
    on_device = True
    drafter_probabilities = True


class MixedProposer(Proposer):
    """The drafter's beams, the lowest-ranked ones replaced by context N-gram matches of at least `min_match` tokens
    (`ngram_beams` of them at most); without a match, the tree the step packed stays."""

    name = "mixed"
    on_device = True
    on_host = True
    wants_device_beams = True

    def __init__(self, ngram, ngram_beams: int, min_match: int):
        self.ngram, self.ngram_beams, self.min_match = ngram, ngram_beams, min_match

    def compose(self, seq: Sequence, device: Optional[Draft]) -> Optional[Draft]:
        if device is None:  # the step did not draft (an AR step): the context's matches alone, if any
            return self.ngram.context_draft(seq, self.ngram_beams, self.min_match)
        ctx = self.ngram.context_draft(seq, self.ngram_beams, self.min_match, fill=False)
        nb = len(device.rows)
        rows, scores = list(device.rows), list(device.scores)
        new = [(r, s) for r, s in zip(ctx.rows, ctx.scores) if r not in rows][:nb]
        if not new:
            return None
        keep = nb - len(new)
        return Draft(rows[:keep] + [r for r, _ in new], scores[:keep] + [s for _, s in new])
