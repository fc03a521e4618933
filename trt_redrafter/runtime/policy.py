"""The speculation policy: how much of each draft tree a step verifies, down to none.

A tree is worth verifying only where the tokens it is expected to add pay for what verifying it adds to the step.
Both sides are measured, not assumed:

    CostModel    (costs.py) step time by batch size and verified tree nodes T, measured on this machine for this
                 engine and cached beside it: `ar` (an AR step) and `tree` (a step that verifies T nodes of every
                 request's tree and drafts the next trees). The steps as they run scale it: each kind's running ratio
                 of measured to modelled time (`Policy.observe_step`), since a machine's speed moves in phases (a
                 shared host's memory bandwidth) and a memory-bound AR step moves more than a tree step.
    Calibration  (calibration.py) P(a drafted node is accepted | the proposer's score for it), learned from every
                 verified node's outcome, per proposer and acceptance rule.
    Policy       per step, for the whole batch: an AR step, or a tree step over T (one of a few static buckets)
                 nodes with a `keep` per request (<= T: requests without a fresh tree keep their root only). Trees are
                 numbered best node first (step.py), so the first T nodes are the T worth most, and pruning removes
                 candidates only: output never changes.

Two decisions, each by tokens per millisecond. Which width: the T (1 included: verify nothing, draft the next trees)
whose step emits the most per millisecond for the trees at hand. Whether to draft at all (a tree step drafts the next
trees, an AR step does not): while the running means of what drafting steps emit and cost, in AR steps, say they pay.
When they do not (a drafter that is wrong, a batch so large that verifying is compute-bound), the policy takes AR
steps; as those draft nothing, it probes after PROBE_MIN steps, backing off to PROBE_MAX while probes find nothing
worth verifying, and waits PROBE_MAX where the requests' last trees, drafted again, would not pay either. A probe is
a step that drafts (width 1) and then one that verifies the fresh trees where the proposer's own claims say they
would pay, whatever the calibration says: a calibration that turned pessimistic on a hard stretch of text learns
only from verified nodes, and a policy that stopped verifying would never see the drafter recover.

Trees composed on the host between steps (N-gram, a test's oracle) cost host time as well as the verify: where every
tree of the batch comes from the host, that time (a running mean per request, measured) is added to the tree step's
cost, and while their trees do not pay the policy rests from composing them too (`StepDecision.compose`), composing
again to probe after PROBE_MIN AR steps, backing off to PROBE_MAX.

The published anchors: EAGLE-2 (trees from draft confidence), SpecDec++ (stop drafting when acceptance is unlikely),
SmartSpec and vLLM's dynamic speculation (speculate only while goodput gains: less under load).

Every TP rank runs the decisions rank 0 made (the scheduler broadcasts them with the step plan), so a cost model
measured per rank, or a float rounded differently, can never make ranks disagree.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Hashable, Optional

from ..config import Speculation
from .calibration import Calibration
from .costs import CostModel
from .graphs import tree_buckets
from .step import SCORE_SCALE

PROBE_MIN, PROBE_MAX = 4, 64  # AR steps between probes while resting (doubling while probes find nothing)
PROBE_HOPE = 0.95  # probe sooner than PROBE_MAX only where the last trees, drafted again, would nearly pay
MEAN_DECAY = 0.8  # running means of a drafting step's gain and cost: weight of the past
# the cost model, measured once, against the steps as they run now: a running mean (weight of the past) of each kind's
# measured / modelled step time, each observation clamped to [1 / STEP_SCALE_CLAMP, STEP_SCALE_CLAMP]
STEP_SCALE_DECAY, STEP_SCALE_CLAMP = 0.9, 2.0



# ---- the decision -------------------------------------------------------------------------------------------------

@dataclass
class Candidate:
    """One decoding request as the policy sees it."""

    seq_id: Hashable
    speculative: bool  # mode redrafter (an AR request rides along with keep 1)
    scores: Optional[list[int]]  # its tree's node scores, best first (root first), or None: no tree yet
    calibration: Optional[Calibration] = None
    fresh: bool = True  # its tree was drafted after its last step (else it is the last tree it had: a forecast)
    whole_tree: bool = False  # `apple` acceptance: verifies its whole tree every step
    context: int = 0


@dataclass
class StepDecision:
    """What a decode step does, decided on rank 0 and broadcast with the step plan: an AR step (`width` 0) or a
    tree step over `width` nodes that keeps keep[seq_id] of them per request and drafts the next trees (`draft`)."""

    width: int
    keep: dict[Hashable, int] = field(default_factory=dict)
    draft: bool = True
    expected: float = 0.0  # tokens per request the policy expected (tree steps), for the record
    compose: bool = True  # host proposers compose the next trees after this step (not while the policy rests)

    @property
    def is_tree(self) -> bool:
        return self.width > 0


AR_STEP = StepDecision(0, {}, False)
AR_REST = StepDecision(0, {}, False, compose=False)  # resting from host trees: an AR step, and no tree composed


class Policy:
    """Chooses each step's StepDecision, as `speculation` says: auto (by the cost model), full (every tree whole,
    every step: what TensorRT-LLM does) or an integer T (the T best nodes of every tree, every step)."""

    def __init__(self, speculation: Speculation, max_tree_tokens: int, costs: Optional[CostModel] = None):
        self.speculation = speculation
        self.P = max_tree_tokens
        self.widths = tree_buckets(max_tree_tokens)
        self.costs = costs  # what `auto` decides by (the engine measures or loads it)
        self.rest, self.probe_every, self.probing, self.hopeless = 0, PROBE_MIN, False, False
        self.speculating, self.mean_gain, self.mean_cost, self.mean_batch = False, 1.0, 1.0, 0
        self.calibrations: dict[tuple[str, bool], Calibration] = {}
        self.host_ms, self.host_resting = 0.0, False  # ms to compose one request's tree on the host (running mean)
        self.step_scale = [1.0, 1.0]  # measured / modelled step time, running means: AR steps, tree steps
        self._last_kind: Optional[int] = None  # the kind of the last step observed (0 AR, 1 tree)

    def observe_step(self, decision: StepDecision, batch: int, context: float, ms: float) -> None:
        """A decode step's measured time (launch to read-back, as the cost model times it), by the engine after each
        step: the running ratio of measured to modelled time of its kind. Only where the policy decides by the cost
        model and the step is one it models (an AR step, or a tree step that drafted)."""
        if not self.speculation.auto or self.costs is None:
            return
        if decision.is_tree and not decision.draft:
            return
        k = int(decision.is_tree)
        switched, self._last_kind = self._last_kind != k, k
        if switched:
            # the first step of a kind after the other kind (a probe among AR steps, an AR step after trees) finds
            # its graph's code and weights out of cache: a cost that a run of such steps, which the cost model
            # times and the policy weighs, does not pay; observed, it would make lone probes look dear and keep
            # the policy from trees that pay
            return
        model = self.costs.tree_ms(batch, decision.width, context) if decision.is_tree else \
            self.costs.ar_ms(batch, context)
        ratio = min(max(ms / model, 1 / STEP_SCALE_CLAMP), STEP_SCALE_CLAMP)
        self.step_scale[k] = STEP_SCALE_DECAY * self.step_scale[k] + (1 - STEP_SCALE_DECAY) * ratio

    def observe_host(self, ms_per_request: float) -> None:
        """The host's time to compose one request's tree, measured by the engine after each step that composed."""
        self.host_ms = ms_per_request if self.host_ms == 0 else \
            MEAN_DECAY * self.host_ms + (1 - MEAN_DECAY) * ms_per_request

    def end_step(self) -> None:
        """One step passed: every calibration's old outcomes fade (calibration.DECAY)."""
        for cal in self.calibrations.values():
            cal.decay()

    def calibration(self, proposer: str, greedy: bool) -> Calibration:
        key = (proposer, greedy)
        cal = self.calibrations.get(key)
        if cal is None:
            cal = self.calibrations[key] = Calibration()
        return cal

    def fixed_width(self) -> Optional[int]:
        return self.speculation.fixed_width(self.P)

    def decide(self, cands: list[Candidate], can_draft: bool) -> StepDecision:
        """The step for these decoding requests. `can_draft`: some request's next tree is drafted on the device (a
        tree step drafts, an AR step does not; without it, trees come from the host, composed after any step the
        decision does not rest)."""
        d = self._decide(cands, can_draft)
        if d is AR_STEP and self.host_resting and self.rest + 1 < self.probe_every:
            return AR_REST  # the next step is an AR step too: nothing to compose for it
        return d

    def _decide(self, cands: list[Candidate], can_draft: bool) -> StepDecision:
        if can_draft:
            self.host_resting = False
        spec = [c for c in cands if c.speculative]
        if not spec:
            return AR_STEP
        fresh = [c for c in spec if c.scores and c.fresh]
        whole = any(c.whole_tree for c in spec)
        fixed = self.P if whole else self.fixed_width()
        if fixed is not None:
            if not fresh and not can_draft:
                return AR_STEP
            width = fixed if fresh else 1
            return StepDecision(width, self._keep(cands, width), can_draft)
        B = len(cands)
        context = sum(c.context for c in cands) / B
        costs = self.costs
        ar_ms = costs.ar_ms(B, context) * self.step_scale[0]
        if not fresh:  # resting: AR steps, and a probe (a step that drafts) when trees might pay again
            self.rest += 1
            if not can_draft or self.rest < self.probe_every:
                return AR_STEP
            hopeful = False
            if not self.hopeless:  # asked once per rest: the stale trees do not change while nothing drafts
                stale = [c for c in spec if c.scores]  # their last trees, as if drafted again now
                width, expected, ms = self._best(stale, B, context, widths=self.widths)
                hopeful = (B + expected) / ms >= PROBE_HOPE * B / ar_ms
                self.hopeless = not hopeful
            if hopeful or self.rest >= PROBE_MAX:
                self.rest, self.probe_every = 0, min(2 * self.probe_every, PROBE_MAX)
                self.speculating, self.probing, self.hopeless = False, True, False
                return StepDecision(1, {c.seq_id: 1 for c in cands}, True)
            return AR_STEP
        widths = self.widths if can_draft else self.widths[1:]  # width 1: verify nothing, draft the next trees
        if self.probing and can_draft:  # the probe's second step: verify the fresh trees if their claims would pay
            self.probing = False
            width, expected, ms = self._best(fresh, B, context, self.widths[1:], claims=True)
            if (B + expected) / ms > B / ar_ms:
                return StepDecision(width, self._keep(cands, width), True, expected / B)
        width, expected, ms = self._best(fresh, B, context, widths)
        if not can_draft:  # trees from the host: verify the best part of them, or take AR steps and rest from them
            host = self.host_ms * len(fresh)  # what composing these trees again costs, whatever width is verified
            if (B + expected) / (ms + host) > B / ar_ms:
                self.host_resting, self.rest, self.probe_every = False, 0, PROBE_MIN
                return StepDecision(width, self._keep(cands, width), False, expected / B)
            if self.host_resting:  # a probe that found nothing worth it: wait twice as long for the next
                self.probe_every = min(2 * self.probe_every, PROBE_MAX)
            self.host_resting, self.rest = True, 0
            return AR_STEP
        # drafting: worth its cost while the trees it makes pay on average (running means, at this batch size, of
        # what a step emits and costs in AR steps); a run of trees with nothing worth verifying stops it
        gain, cost = 1 + expected / B, ms / ar_ms
        if not self.speculating or B != self.mean_batch:  # the means hold for one batch size
            self.mean_gain, self.mean_cost, self.mean_batch, self.speculating = gain, cost, B, True
        else:
            self.mean_gain = MEAN_DECAY * self.mean_gain + (1 - MEAN_DECAY) * gain
            self.mean_cost = MEAN_DECAY * self.mean_cost + (1 - MEAN_DECAY) * cost
        if self.mean_gain >= self.mean_cost:
            self.rest, self.probe_every = 0, PROBE_MIN
            return StepDecision(width, self._keep(cands, width), True, expected / B)
        self.rest, self.speculating, self.hopeless = 0, False, False
        return AR_STEP

    def _best(self, cands: list[Candidate], B: int, context: float, widths: list[int], claims: bool = False
              ) -> tuple[int, float, float]:
        """The width whose step emits the most tokens per millisecond for these trees -> (width, expected drafted
        tokens accepted over the batch, step ms). `claims`: by the proposer's own scores, not the calibration."""
        gains = [self._gains(c, claims) for c in cands]
        best = None
        for w in widths:
            expected = sum(g[min(w, len(g)) - 1] for g in gains)
            ms = self.costs.tree_ms(B, w, context) * self.step_scale[1]
            if best is None or (B + expected) / ms > (B + best[1]) / best[2]:
                best = (w, expected, ms)
        return best

    def _gains(self, c: Candidate, claims: bool = False) -> list[float]:
        """g[k - 1]: tokens expected from the request's first k nodes (the root adds none)."""
        p = (lambda s: math.exp(s / SCORE_SCALE)) if claims else c.calibration.probability
        return list(itertools.accumulate(map(p, c.scores[1:]), initial=0.0))

    @staticmethod
    def _keep(cands: list[Candidate], width: int) -> dict[Hashable, int]:
        return {c.seq_id: (min(width, len(c.scores)) if c.speculative and c.scores and c.fresh else 1)
                for c in cands}
