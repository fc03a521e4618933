"""Proposers: what fills a speculative request's draft tree, with a score (log-confidence) for every node.

Every proposer answers the same question, "which drafts, and how sure are you of each?", and every tree it proposes
goes through the one speculation policy (policy.py), which verifies as much of it as pays for itself. A tree is nb
beams of bl tokens (column 0 the request's true token) and, per beam, the scores of its prefixes (quantized
log-probabilities, step.quantize_scores): the score of a node is the proposer's confidence in the whole path to it.

    Proposer           the interface the engine asks, one object per name in config.PROPOSERS:
        ReDrafterProposer  the device drafter's trees as they are
        NgramProposer      (ngram.py) trees composed on the host from the request's context and the base's bigrams
        MixedProposer      the device drafter's beams with context N-gram matches in place of its lowest-ranked ones
Tests pass their own Proposer to the engine (oracles that know the continuation) and it drafts every request.

A proposer says where its trees come from (its `drafter`: the step drafts them with the device drafter, drafter.py;
`on_host`: `compose` makes them between steps, packed at the start of the next step), and whether the `apple`
acceptance rule can use them (`drafter_probabilities`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Iterable, Optional

from ..config import AcceptanceRule, DecodingMode
from ..errors import UserError
from .drafter import DeviceDrafter
from .sequence import Draft, RequestSpec, Sequence, TreeNodes
from .step import StepRow

@dataclass(frozen=True)
class HostCompose:
    """A request's next tree is composed on the host after this step (`Proposer.compose`), from the device's beams
    where the step drafted and returned them (`device`)."""

    device: Optional[Draft] = None


class Proposer:
    """What fills the trees of the requests that name it, and what it needs of each step. A proposer owns its device
    drafter (`drafter`: the step drafts its requests' next trees with it; None: it drafts nothing on the device), its
    host composition (`compose`, where `on_host`) and its per-request state (`Sequence.proposer_state`, a subclass of
    sequence.ProposerState of its own). The engine asks it, after a request's prompt step and each decode step, what
    comes next (`after_prompt`, `after_step`); adding a proposer is a subclass and its line in
    `loading.make_proposers`."""

    name: ClassVar[str] = ""
    needs_drafter: ClassVar[bool] = False  # it cannot propose without a device drafter
    on_host: ClassVar[bool] = False  # `compose` makes its next tree on the host between steps
    wants_device_beams: ClassVar[bool] = False  # `compose` starts from the device's beams (read back with the step)
    drafter_probabilities: ClassVar[bool] = False  # its trees carry the drafter's distributions (`apple` rule)
    drafter: Optional[DeviceDrafter] = None  # the device drafter that drafts its requests' next trees in the step

    def __init__(self, drafter: Optional[DeviceDrafter] = None):
        self.drafter = drafter if self.needs_drafter else None

    def check(self, spec: RequestSpec) -> None:
        """Refuse, in one sentence, a request this proposer cannot serve."""
        if self.needs_drafter and self.drafter is None:
            raise UserError(f"proposer {self.name!r} needs a drafter, and this engine was built without one; use "
                            f"proposer 'ngram' (or rebuild with --drafter DIR).")
        if spec.mode is DecodingMode.TREE and not self.drafter_probabilities and \
                spec.params.resolved_acceptance is AcceptanceRule.APPLE:
            raise UserError(f"acceptance 'apple' weighs each draft by the drafter's probabilities, which "
                            f"{self.name!r} drafts do not have; use acceptance 'exact' (distribution-exact).")

    def after_prompt(self, seq: Sequence, nodes: Optional[TreeNodes], device: Optional[Draft]
                     ) -> Optional[HostCompose]:
        """After `seq`'s prompt step: `nodes`, the first tree the device drafted and packed (None: it drafted none for
        this request), and its beams where `wants_device_beams`."""
        if nodes is not None:
            seq.tree, seq.tree_fresh = nodes, True
        return HostCompose(device) if self.on_host else None

    def after_step(self, seq: Sequence, row: Optional[StepRow], composing: bool) -> Optional[HostCompose]:
        """After a decode step: `row`, what a tree step returned for `seq` (None: an AR step); `composing`: the
        policy wants host trees composed after an AR step (it does not while it rests from them)."""
        if row is None:
            return HostCompose() if self.on_host and composing else None
        if row.nodes is not None and self.drafter is not None:
            seq.tree, seq.tree_fresh = row.nodes, True
        return HostCompose(row.draft) if self.on_host else None

    def compose(self, seq: Sequence, device: Optional[Draft]) -> Optional[Draft]:
        """The next tree of `seq` (after its last step: seq.true_token is the root), from the device's draft where
        `wants_device_beams` and the step drafted. None: keep the tree the step packed (a device drafter's), or
        nothing to verify (the policy then has no tree for this request)."""
        return None

    def host_tree_cases(self) -> tuple[bool, ...]:
        """Whether a tree step over its requests packs trees the host composed: True, False, or either (the warm-up
        compiles a variant for each)."""
        if not self.on_host:
            return (False,)
        return (True, False) if self.drafter is not None else (True,)


def drafts_on_device(proposers: Iterable[Proposer]) -> bool:
    """Whether a step over requests with these proposers runs the device drafter."""
    return any(p.drafter is not None for p in proposers)


def returns_device_beams(proposers: Iterable[Proposer]) -> bool:
    """Whether a step that drafts on the device returns the beams to the host too (a proposer composes from them)."""
    return any(p.wants_device_beams for p in proposers)


class ReDrafterProposer(Proposer):
    """The device drafter's trees, as its beam search drafts them."""

    name = "redrafter"
    needs_drafter = True
    drafter_probabilities = True


class MixedProposer(Proposer):
    """The drafter's beams, the lowest-ranked ones replaced by context N-gram matches of at least `min_match` tokens
    (`ngram_beams` of them at most); without a match, the tree the step packed stays."""

    name = "mixed"
    needs_drafter = True
    on_host = True
    wants_device_beams = True

    def __init__(self, drafter: Optional[DeviceDrafter], ngram, ngram_beams: int, min_match: int):
        super().__init__(drafter)
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
