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
worth verifying, and waits PROBE_MAX where the requests' last trees, drafted again, would not pay either (but not
where drafting that paid stopped close to paying: `faded`). A probe is a step that drafts (width 1) and then one that
verifies the fresh trees where the proposer's own claims say they would pay, whatever the calibration says: a
calibration that turned pessimistic on a hard stretch of text learns only from verified nodes, and a policy that
stopped verifying would never see the drafter recover.

A third, where one compiled step drafts any beam count or depth (eager, inductor on the CPU: each is an unbacked
size, step.py `_propose`): how many beams a drafting step searches for the next trees, and how many tokens deep.
Drafting costs per beam and per depth (the cost model measures a width-1 step at each count and each depth): a
drafter whose other beams are never right wastes them, and one whose deeper tokens are never accepted wastes a read
of its weights at each further depth. The trees at hand, cut to their first k beams and first d depths, forecast what
(k, d) would earn (`_next_draft`).

Trees composed on the host between steps (N-gram, a test's oracle) cost host time as well as the verify: where every
tree of the batch comes from the host, that time (a running mean per request, measured) is added to the tree step's
cost, and while their trees do not pay the policy rests from composing them too (`StepDecision.compose`), composing
again to probe after PROBE_MIN AR steps, backing off to PROBE_MAX.

The published anchors: EAGLE-2 (trees from draft confidence), SpecDec++ (stop drafting when acceptance is unlikely),
SmartSpec and vLLM's dynamic speculation (speculate only while goodput gains: less under load).

The decision is a pure function, `decide`: (the policy's state, the batch, what steps cost) -> (the step, the next
state). Its state, `PolicyState`, holds the phase (speculating, resting, probing; resting from host trees apart) and
its counters, and `decide`'s docstring tables every transition; `Policy` holds what is measured (the cost model and
its running scale, the host's composing time, the calibrations) and the current state, and calls it.

Every TP rank runs the decisions rank 0 made (the scheduler broadcasts them with the step plan), so a cost model
measured per rank, or a float rounded differently, can never make ranks disagree.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import math
from dataclasses import dataclass, field
from typing import Hashable, Optional, Sequence

from ..config import Speculation
from .calibration import Calibration
from .costs import CostModel
from .graphs import tree_buckets
from .step import SCORE_PAD, SCORE_SCALE

PROBE_MIN, PROBE_MAX = 4, 64  # AR steps between probes while resting (doubling while probes find nothing)
BEAM_EXPLORE = 8  # drafting steps with fewer beams or less depth, after which one drafts the whole tree (chosen again)
PROBE_HOPE = 0.95  # probe sooner than PROBE_MAX only where the last trees nearly pay, or drafting faded this close
# what failed probes may cost: a probe (and the switches into it and back) costs at most this share of the AR steps
# rested before it. SmolLM2 bf16: a probe ~0.4 AR steps more, rests of 9 steps at batch 1; a model whose AR step is a
# fraction of a millisecond (models/small: ~4 AR steps more, the host's time after a tree step and the switches) 80-odd
PROBE_BUDGET = 0.05
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
    # the lowest beam through each node (aligned with `scores`) of a tree the device drafted; None: composed on the
    # host (every node counts for every beam count)
    beams: Optional[list[int]] = None
    depths: Optional[list[int]] = None  # each node's depth (aligned with `scores`); None: unknown
    # what `_gains` and `_node_probs` computed for one decision, by what they were asked (`decide` clears it)
    memo: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def drafted_depth(self) -> int:
        """How many tokens deep the drafter searched for this tree (0: unknown): the deepest node it drafted. A search
        that stopped early leaves the nodes past its depth at SCORE_PAD (step.py `_propose`)."""
        if not self.depths or not self.beams:
            return 0
        return max((d for d, s in zip(self.depths[1:], self.scores[1:]) if s > SCORE_PAD), default=0)

    @property
    def drafted_beams(self) -> int:
        """How many beams the drafter searched for this tree (0: unknown). A search of k beams fills the other slots
        with copies of beam 0, and every beam it found has a node of its own (beams are distinct), so the highest
        beam index through a node is k - 1."""
        return 1 + max(self.beams) if self.beams else 0


@dataclass
class StepDecision:
    """What a decode step does, decided on rank 0 and broadcast with the step plan: an AR step (`width` 0) or a
    tree step over `width` nodes that keeps keep[seq_id] of them per request and drafts the next trees (`draft`)
    with `beams` beams (0: the tree's nb), `depth` tokens deep (0: the tree's dl)."""

    width: int
    keep: dict[Hashable, int] = field(default_factory=dict)
    draft: bool = True
    expected: float = 0.0  # tokens per request the policy expected (tree steps), for the record
    compose: bool = True  # host proposers compose the next trees after this step (not while the policy rests)
    beams: int = 0
    depth: int = 0

    @property
    def is_tree(self) -> bool:
        return self.width > 0


AR_STEP = StepDecision(0, {}, False)
AR_REST = StepDecision(0, {}, False, compose=False)  # resting from host trees: an AR step, and no tree composed


class Phase(enum.Enum):
    """Where the policy stands on drafting on the device (`decide` tables the transitions)."""

    RESTING = "resting"  # no verdict that drafting pays (as it starts): stale trees get AR steps, now and then a probe
    PROBING = "probing"  # a probe drafted: the next fresh trees are verified where the proposer's claims say they pay
    SPECULATING = "speculating"  # drafting pays, by the running means of its gain and cost (at `mean_batch`)


@dataclass(frozen=True)
class PolicyState:
    """What the policy carries from one decision to the next; `decide` makes a new one, never changes one.
    `host_resting` is apart from `phase`: trees composed on the host come and go with the batch's requests, and a
    batch that cannot draft on the device keeps the device's phase for when it can again."""

    phase: Phase = Phase.RESTING
    host_resting: bool = False  # resting from host trees: AR steps that compose nothing (but the one before a probe)
    rest: int = 0  # AR steps while resting, since it began or since the last probe
    probe_every: int = PROBE_MIN  # ... after which the next probe comes (doubling while probes find nothing)
    # the batch size at which the stale trees, weighed once per rest and batch size, would not pay (0: not weighed, or
    # they would): no probe before PROBE_MAX while the batch keeps that size (a probe, or drafting that stops paying,
    # clears it)
    hopeless: int = 0
    mean_gain: float = 1.0  # SPECULATING: running means of a drafting step's tokens and cost, in AR steps, ...
    mean_cost: float = 1.0
    mean_batch: int = 0  # ... at this batch size (the cost's restarts where it changes, the gain's where it grows)
    # the batch size at which drafting that paid stopped on running means within PROBE_HOPE of paying (0: it did not,
    # or never paid): probes on the doubling schedule while the batch keeps that size, whatever the last trees say
    faded: int = 0
    # drafting steps with fewer beams than every one, or less depth than the whole, in a row: at BEAM_EXPLORE the next
    # drafts the whole tree
    beam_hold: int = 0
    # (batch size, StepCosts.probe_rest): the fewest AR steps before a probe, weighed once per rest and batch size
    least_rest: tuple[int, int] = (0, 0)


def _replace(s: PolicyState, **changes) -> PolicyState:
    """`dataclasses.replace` for the policy's state, a fifth of its cost (0.4 against 2.1 us: a decision makes one to
    three, on a small model's 0.2 ms steps): the fields copied as they are, `changes` over them. PolicyState has no
    __post_init__ and no field that init leaves out."""
    assert changes.keys() <= s.__dict__.keys(), changes  # as replace's TypeError: no field made up
    new = object.__new__(PolicyState)
    new.__dict__.update(s.__dict__, **changes)
    return new


@dataclass(frozen=True)
class StepCosts:
    """What a decision weighs steps by, read-only: the measured cost model scaled by the steps as they run (`scale`:
    AR steps, tree steps; Policy.observe_step), plus the host's time between steps after each kind (`between`:
    committing the step's tokens, deciding the next, the scheduler's turn; Policy.observe_between), and the host's
    time to compose one request's tree (Policy.observe_host). `model` is None where the policy decides by no cost model
    (fixed widths)."""

    model: Optional[CostModel]
    scale: tuple[float, float] = (1.0, 1.0)
    host_ms: float = 0.0
    between: tuple[float, float] = (0.0, 0.0)
    switch: tuple[float, float] = (0.0, 0.0)  # what the first AR step after trees, and the first tree step after AR
    # steps, cost over a step of a run of its kind (Policy.observe_step)

    def probe_rest(self, batch: int, context: float) -> int:
        """AR steps to rest before a probe, at least: a probe (a width-1 tree step that drafts) costs its tree step, the
        switch into it and the switch back to AR steps; rested this long, failed probes cost at most PROBE_BUDGET of the
        time."""
        ar = self.ar_ms(batch, context)
        extra = self.tree_ms(batch, 1, context) + self.switch[1] + self.switch[0] - ar
        return math.ceil(max(extra, 0.0) / (ar * PROBE_BUDGET))

    def ar_ms(self, batch: int, context: float) -> float:
        return self._ar_launch(batch, context) + self.between[0]

    def tree_ms(self, batch: int, width: int, context: float, beams: int = 0, depth: int = 0) -> float:
        return self.tree_ms_at(batch, (width,), context, beams, depth)[0]

    def tree_ms_at(self, batch: int, widths: Sequence[int], context: float, beams: int = 0, depth: int = 0
                   ) -> list[float]:
        """`tree_ms` at each of `widths`, looked up together (CostModel.tree_ms_at)."""
        # never below an AR step: a tree step runs the AR step's forward and more. The scales (or less host time seen
        # after trees than after AR steps) can price it lower (a busy phase slows the many AR steps, while a lone
        # probe is never observed), and a drafter that is never right then drafted on, as if for free
        floor, scale, between = self.ar_ms(batch, context), self.scale[1], self.between[1]
        return [max(ms * scale + between, floor)
                for ms in self.model.tree_ms_at(batch, widths, context, beams, depth)]

    def _ar_launch(self, batch: int, context: float) -> float:
        return self.model.ar_ms(batch, context) * self.scale[0]


def decide(state: PolicyState, cands: list[Candidate], can_draft: bool, costs: StepCosts, widths: Sequence[int],
           fixed: Optional[int], beam_options: Sequence[int] = (), depth_options: Sequence[int] = ()
           ) -> tuple[StepDecision, PolicyState]:
    """The step for these decoding requests, and the state after it; nothing is changed. `can_draft`: some request's
    next tree is drafted on the device (a tree step drafts, an AR step does not; without it, trees come from the host,
    composed after any step the decision does not rest). `widths`: the widths a tree step may verify (tree_buckets:
    1 first, the whole tree last); `fixed`: the width every step verifies (None: the cost model decides);
    `beam_options`: the beam counts a drafting step may search, ascending, the tree's nb last (one: no choice; empty:
    nb); `depth_options` likewise the depths, the tree's dl last. A fixed width drafts with the first option of each
    where it is the only one, else the whole tree; so do probes.

    Trees are fresh (drafted after the request's last step) or stale (its last tree again, or none). The transitions,
    all of them here (`rest` counts AR steps, `probe_every` doubles up to PROBE_MAX):

      phase        on                                                   -> phase        the step; counters
      any          no speculative request                               -> same         AR step
      any          a fixed width (the setting, or an `apple` request)   -> same         that width (1 for stale trees
                                                                                        that can draft; else AR step)
      any          stale trees (no fresh one), cannot draft, or         -> same         AR step; rest + 1
                   rest + 1 < probe_every, or rest + 1 < least (what a
                   probe costs over PROBE_BUDGET: StepCosts.probe_rest)
      any          stale trees, can draft, rest + 1 >= both, and        -> PROBING      a probe: width 1, drafts; rest
                   the trees, drafted again, would nearly pay (asked                    0, probe_every doubled,
                   once per rest and batch size: `hopeless`), or                        hopeless cleared
                   drafting faded close to paying at this batch size
                   (`faded`), or rest + 1 >= max(PROBE_MAX, least)
                   ... neither                                          -> same         AR step; rest + 1, hopeless
                                                                                        set to the batch size where
                                                                                        they would not pay
      PROBING      fresh trees, can draft, their claims pay             -> RESTING      verify them by their claims
      PROBING      fresh trees, can draft, their claims do not pay      -> as RESTING below
      RESTING      fresh trees, can draft: the running means start      -> SPECULATING  tree step, drafts; rest 0,
      SPECULATING  (go on; the cost's restarts where the batch size                     probe_every PROBE_MIN
                   changed, the gain's where it grew) and pay
                   ... and do not pay                                   -> RESTING      AR step; rest 0, hopeless
                                                                                        cleared; faded = B where
                                                                                        SPECULATING and the means
                                                                                        are within PROBE_HOPE
      any          fresh trees, cannot draft (from the host), that pay  -> same         tree step, no drafting; rest
                   for their verify and their composing                                 0, probe_every PROBE_MIN,
                                                                                        host_resting off
                   ... that do not                                      -> same         AR step; rest 0, host_resting
                                                                                        on (probe_every doubled where
                                                                                        it was on already)
      any          can draft                                            host_resting off (before all the above)

    The beam count and depth of a tree step that drafts while SPECULATING (`_next_draft`): the fresh trees at hand
    are the forecast of the next ones. Of the counts and depths up to those they were drafted with, the pair whose
    trees (their nodes on the first k beams, d deep) emit the most per millisecond at their best width, counting what
    drafting k beams d deep costs; the whole tree after BEAM_EXPLORE drafting steps in a row with less (what more
    beams or depth would find is seen only in trees that have them: a whole tree now and then makes the choice
    again).

    While host_resting, an AR step composes nothing (AR_REST) but the last before rest reaches probe_every: that one
    composes the trees that probe whether host trees pay again."""
    for c in cands:  # what this decision weighs: a caller may ask again after the calibration learned more
        c.memo.clear()
    d, state = _decide(state, cands, can_draft, costs, widths, fixed, beam_options, depth_options)
    if d is AR_STEP and state.host_resting and state.rest + 1 < state.probe_every:
        return AR_REST, state  # the next step is an AR step too: nothing to compose for it
    return d, state


def _decide(s: PolicyState, cands: list[Candidate], can_draft: bool, costs: StepCosts, widths: Sequence[int],
            fixed: Optional[int], beam_options: Sequence[int], depth_options: Sequence[int] = ()
            ) -> tuple[StepDecision, PolicyState]:
    if can_draft and s.host_resting:
        s = _replace(s, host_resting=False)
    spec = [c for c in cands if c.speculative]
    if not spec:
        return AR_STEP, s
    fresh = [c for c in spec if c.scores and c.fresh]
    if any(c.whole_tree for c in spec):
        fixed = widths[-1]
    if fixed is not None:
        if not fresh and not can_draft:
            return AR_STEP, s
        width = fixed if fresh else 1
        beams = beam_options[0] if len(beam_options) == 1 else 0
        depth = depth_options[0] if len(depth_options) == 1 else 0
        return StepDecision(width, _keep(cands, width), can_draft, beams=beams, depth=depth), s
    B = len(cands)
    context = sum(c.context for c in cands) / B
    if not fresh:  # resting: AR steps, and a probe (a step that drafts) when trees might pay again
        rest = s.rest + 1
        if not can_draft or rest < s.probe_every:  # (most steps of a rest: decided before any cost is looked up)
            return AR_STEP, _replace(s, rest=rest)
        # ... never so often that failed probes cost more than PROBE_BUDGET (weighed when the rest first reaches
        # probe_every, and again where the batch size changed)
        at, least = s.least_rest
        if at != B or rest == s.probe_every:
            least = costs.probe_rest(B, context)
            s = _replace(s, least_rest=(B, least))
        if rest < least:
            return AR_STEP, _replace(s, rest=rest)
        # drafting that paid and faded close to paying at this batch size: one pessimistic last tree (or probe) must
        # not hold off probes for PROBE_MAX steps, the rest of a short answer (the quickstart's first, at batch 3,
        # rested 31 steps on means of 1.53 tokens against 1.55). A rest that never speculated (a large batch from its
        # start) has only the last trees to hope by
        hopeful, hopeless = s.faded == B, s.hopeless
        if not hopeful and hopeless != B:  # asked once per rest and batch size: the stale trees do not change while
            # nothing drafts, but what verifying them costs does with the batch (requests that finish can leave one
            # that would pay)
            stale = [c for c in spec if c.scores]  # their last trees, as if drafted again now
            width, expected, ms = _best(stale, B, context, widths, costs)
            hopeful = (B + expected) / ms >= PROBE_HOPE * B / costs.ar_ms(B, context)
            hopeless = 0 if hopeful else B
        if hopeful or rest >= max(PROBE_MAX, least):
            probe = StepDecision(1, {c.seq_id: 1 for c in cands}, True)
            return probe, _replace(s, phase=Phase.PROBING, rest=0, probe_every=min(2 * s.probe_every, PROBE_MAX),
                                  hopeless=0)
        return AR_STEP, _replace(s, rest=rest, hopeless=hopeless)
    ar_ms = costs.ar_ms(B, context)
    if not can_draft:  # trees from the host: verify the best part of them, or take AR steps and rest from them
        width, expected, ms = _best(fresh, B, context, widths[1:], costs)  # width 1 would verify nothing
        host = costs.host_ms * len(fresh)  # what composing these trees again costs, whatever width is verified
        if (B + expected) / (ms + host) > B / ar_ms:
            return (StepDecision(width, _keep(cands, width), False, expected / B),
                    _replace(s, host_resting=False, rest=0, probe_every=PROBE_MIN))
        # a probe that found nothing worth it (resting already): wait twice as long for the next
        probe_every = min(2 * s.probe_every, PROBE_MAX) if s.host_resting else s.probe_every
        return AR_STEP, _replace(s, host_resting=True, rest=0, probe_every=probe_every)
    # probes draft the whole tree (or the only count and depth)
    full = beam_options[0] if len(beam_options) == 1 else 0
    full_depth = depth_options[0] if len(depth_options) == 1 else 0
    if s.phase is Phase.PROBING:  # the probe's second step: verify the fresh trees if their claims would pay
        s = _replace(s, phase=Phase.RESTING)
        width, expected, ms = _best(fresh, B, context, widths[1:], costs, claims=True, beams=full, depth=full_depth)
        if (B + expected) / ms > B / ar_ms:
            return StepDecision(width, _keep(cands, width), True, expected / B, beams=full, depth=full_depth), s
    # drafting: worth its cost while the trees it makes pay on average (running means of what a step emits per
    # request, and of what it costs in AR steps at this batch size); a run of trees with nothing worth verifying stops
    # it. Width 1: verify nothing, draft the next trees
    beams, depth, s = _next_draft(s, fresh, B, context, widths, costs, beam_options, depth_options)
    width, expected, ms = _best(fresh, B, context, widths, costs, beams=beams, depth=depth)
    gain, cost = 1 + expected / B, ms / ar_ms
    if s.phase is not Phase.SPECULATING:
        # a run of tree steps starts: it pays the switch into tree steps and, when it ends, the one back to AR steps
        # (measured: Policy.observe_step), weighed on its first step and fading from the mean as the run goes on. A
        # run of trees that only break even lost to AR by those switches (models/small: 0.1-0.2 ms each, an AR step)
        mean_gain, mean_cost = gain, cost + (costs.switch[0] + costs.switch[1]) / ar_ms
    elif B != s.mean_batch:
        # the batch changed: what a step costs in AR steps changed with it, so that mean restarts. Where requests
        # left, verifying is no dearer than it was, so what drafting earned per request is a floor, and it carries
        # over: restarting it from this one step let a single empty tree stop drafting for the rest of an answer (the
        # quickstart's last request, left alone at batch 1, rested 18 steps). Where requests came, it restarts too
        mean_gain = MEAN_DECAY * s.mean_gain + (1 - MEAN_DECAY) * gain if B < s.mean_batch else gain
        mean_cost = cost
    else:
        mean_gain = MEAN_DECAY * s.mean_gain + (1 - MEAN_DECAY) * gain
        mean_cost = MEAN_DECAY * s.mean_cost + (1 - MEAN_DECAY) * cost
    s = _replace(s, mean_gain=mean_gain, mean_cost=mean_cost, mean_batch=B, rest=0)
    if mean_gain >= mean_cost:
        return (StepDecision(width, _keep(cands, width), True, expected / B, beams=beams, depth=depth),
                _replace(s, phase=Phase.SPECULATING, probe_every=PROBE_MIN, faded=0))
    faded = B if s.phase is Phase.SPECULATING and mean_gain >= PROBE_HOPE * mean_cost else s.faded
    return AR_STEP, _replace(s, phase=Phase.RESTING, hopeless=0, faded=faded)


def _best(cands: list[Candidate], B: int, context: float, widths: Sequence[int], costs: StepCosts,
          claims: bool = False, beams: int = 0, on_beams: int = 0, depth: int = 0, on_depth: int = 0
          ) -> tuple[int, float, float]:
    """The width whose step emits the most tokens per millisecond for these trees -> (width, expected drafted tokens
    accepted over the batch, step ms). `claims`: by the proposer's own scores, not the calibration; `beams`, `depth`:
    the step drafts the next trees with that many beams, that deep (0: all); `on_beams`, `on_depth`: only the trees'
    nodes on their first so many beams, that deep, count (0: all of them)."""
    gains = [_gains(c, claims, on_beams, on_depth) for c in cands]
    best = None
    for w, ms in zip(widths, costs.tree_ms_at(B, widths, context, beams, depth)):
        expected = sum(g[min(w, len(g)) - 1] for g in gains)
        if best is None or (B + expected) / ms > (B + best[1]) / best[2]:
            best = (w, expected, ms)
    return best


def _gains(c: Candidate, claims: bool = False, on_beams: int = 0, on_depth: int = 0) -> list[float]:
    """g[k - 1]: tokens expected from the request's first k nodes (the root adds none); `on_beams`, `on_depth`: of
    the nodes on its first so many beams, that deep (0, or a tree composed on the host: all of them). Nodes past
    where the drafter stopped (SCORE_PAD) add none."""
    key = (claims, on_beams if c.beams else 0, on_depth if c.depths else 0)
    gains = c.memo.get(key)
    if gains is None:  # asked once per beam count and depth weighed, and per width decision: computed once a step
        probs = [p for p, b, d in _node_probs(c, claims)
                 if (not on_beams or not c.beams or b < on_beams) and (not on_depth or not c.depths or d <= on_depth)]
        gains = c.memo[key] = list(itertools.accumulate(probs, initial=0.0))
    return gains


def _node_probs(c: Candidate, claims: bool) -> list[tuple[float, int, int]]:
    """(P(accepted), beam, depth) of each drafted node of the request's tree but the root, in order: by the
    proposer's own claims or by the calibration. Nodes past where the drafter stopped (SCORE_PAD) are left out."""
    key = ("nodes", claims)
    nodes = c.memo.get(key)
    if nodes is None:
        depths = c.depths[1:] if c.depths else [0] * (len(c.scores) - 1)
        beams = c.beams[1:] if c.beams else [0] * (len(c.scores) - 1)
        prob = (lambda s, d: math.exp(s / SCORE_SCALE)) if claims else c.calibration.probability
        nodes = c.memo[key] = [(prob(s, d), b, d) for s, b, d in zip(c.scores[1:], beams, depths) if s > SCORE_PAD]
    return nodes


def _next_draft(s: PolicyState, fresh: list[Candidate], B: int, context: float, widths: Sequence[int],
                costs: StepCosts, beam_options: Sequence[int], depth_options: Sequence[int]
                ) -> tuple[int, int, PolicyState]:
    """The beam count and depth a drafting step searches for the next trees (`decide`'s docstring says how), and the
    state after it. 0 for either where there is no choice (the tree's own)."""
    beam_choice, depth_choice = len(beam_options) >= 2, len(depth_options) >= 2
    if not beam_choice and not depth_choice:
        return (beam_options[0] if beam_options else 0), (depth_options[0] if depth_options else 0), s
    counts = _known(beam_options, [c.drafted_beams for c in fresh])
    depths = _known(depth_options, [c.drafted_depth for c in fresh])
    rated = []
    for k in counts:
        for d in depths:
            width, expected, ms = _best(fresh, B, context, widths, costs, beams=k, on_beams=k, depth=d, on_depth=d)
            rated.append(((B + expected) / ms, k, d))
    _, k, d = max(rated)  # ties: the larger count, then the larger depth
    less = (beam_choice and k < beam_options[-1]) or (depth_choice and d < depth_options[-1])
    hold = s.beam_hold + 1 if less else 0
    if hold > BEAM_EXPLORE:
        k = beam_options[-1] if beam_choice else k
        d = depth_options[-1] if depth_choice else d
        hold = 0
    return k, d, _replace(s, beam_hold=hold)


def _known(options: Sequence[int], drafted: list[int]) -> list[int]:
    """The options (beam counts or depths) the trees at hand forecast: those up to the least any of them was drafted
    with (0: unknown, as the most); the only one, or 0 (the tree's own), where there is no choice."""
    if len(options) < 2:
        return [options[0] if options else 0]
    least = min(d or options[-1] for d in drafted)
    return [x for x in options if x <= least] or list(options[:1])


def _keep(cands: list[Candidate], width: int) -> dict[Hashable, int]:
    """How many of its first `width` nodes each request verifies: its drafted ones (not the nodes past where the
    drafter stopped, at SCORE_PAD, last in the tree), 1 (the root) without a fresh tree."""
    return {c.seq_id: (min(width, sum(1 for x in c.scores if x > SCORE_PAD)) if c.speculative and c.scores and c.fresh
                       else 1) for c in cands}


# ---- the policy ---------------------------------------------------------------------------------------------------

def _running_mean(mean: float, value: float) -> float:
    """A running mean of host times (MEAN_DECAY the past's weight); the first value (mean still 0) starts it."""
    return value if mean == 0 else MEAN_DECAY * mean + (1 - MEAN_DECAY) * value


class Policy:
    """Chooses each step's StepDecision, as `speculation` says: auto (by the cost model), full (every tree whole,
    every step: what TensorRT-LLM does) or an integer T (the T best nodes of every tree, every step). It holds what is
    measured and the decision's state; `decide` (the function) decides."""

    def __init__(self, speculation: Speculation, max_tree_tokens: int, costs: Optional[CostModel] = None,
                 beam_options: Sequence[int] = (), depth_options: Sequence[int] = ()):
        """`beam_options`: the beam counts a drafting step may search (StepLauncher.beam_options, or the one count
        `--draft-beams` fixes; empty: the tree's nb); `depth_options` likewise the depths (StepLauncher.depth_options,
        or the one `--draft-depth` fixes; empty: the tree's dl)."""
        self.speculation = speculation
        self.P = max_tree_tokens
        self.widths = tree_buckets(max_tree_tokens)
        self.beam_options = list(beam_options)
        self.depth_options = list(depth_options)
        self.costs = costs  # what `auto` decides by (the engine measures or loads it)
        self.state = PolicyState()
        self.calibrations: dict[tuple[str, bool], Calibration] = {}
        self.host_ms = 0.0  # ms to compose one request's tree on the host (running mean)
        self.between = [0.0, 0.0]  # ms of host time between steps, after AR steps and after tree steps (running means)
        self.step_scale = [1.0, 1.0]  # measured / modelled step time, running means: AR steps, tree steps
        self.switch = [0.0, 0.0]  # ms a step of each kind costs more after one of the other kind (running means)
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
        last, self._last_kind = self._last_kind, k
        # the step as it ran: a tree step drafting fewer beams or less deep against its own cell, not the whole
        # tree's (which would read its savings as a faster machine, and count them twice)
        model = self.costs.tree_ms(batch, decision.width, context, decision.beams, decision.depth) \
            if decision.is_tree else self.costs.ar_ms(batch, context)
        if last != k:
            # the first step of a kind after the other kind (a probe among AR steps, an AR step after trees) finds
            # its graph's code and weights out of cache: a cost that a run of such steps, which the cost model
            # times and the policy weighs, does not pay. Kept apart (what it costs over the scaled cell): in the
            # scale it would make lone probes look dear and keep the policy from trees that pay; apart, it spaces
            # the probes (StepCosts.probe_rest)
            if last is not None:  # (the first step of all finds everything cold: no switch)
                # clamped as the scale's observations are: a step that compiled a graph of its own is no switch
                expected = model * self.step_scale[k]
                excess = min(max(ms - expected, 0.0), (STEP_SCALE_CLAMP - 1) * expected)
                self.switch[k] = _running_mean(self.switch[k], excess)
            return
        ratio = min(max(ms / model, 1 / STEP_SCALE_CLAMP), STEP_SCALE_CLAMP)
        self.step_scale[k] = STEP_SCALE_DECAY * self.step_scale[k] + (1 - STEP_SCALE_DECAY) * ratio

    @contextlib.contextmanager
    def observations_kept(self):
        """Steps run in the block leave what the policy measured of the steps as it was (the scales, the host's times,
        the switches): steps timed phase by phase (bench-engine's phase breakdown) are not the decode as it runs."""
        saved = (list(self.step_scale), list(self.between), list(self.switch), self.host_ms, self._last_kind)
        try:
            yield
        finally:
            self.step_scale, self.between, self.switch, self.host_ms, self._last_kind = saved

    def observe_prompt_step(self) -> None:
        """A prompt step ran (by the engine): it streamed the prompt's work through the caches, so the next decode step
        finds its code and weights out of cache whatever kind the last one was. Neither a run's step nor a switch:
        observe_step skips it, as it does the first step of all."""
        self._last_kind = None

    def observe_between(self, after_tree: bool, ms: float) -> None:
        """The host's time from one decode step's read-back to the next one's launch (the step's tokens committed, the
        next step decided, the scheduler's turn), by the engine, after a step of the kind `after_tree` says. The cost
        model times launches only; this time is paid per step whatever the step verifies, so on a small model (an AR
        step of 0.15 ms and 0.06 ms between steps) it is what makes several tokens a step pay."""
        if not self.speculation.auto or self.costs is None:
            return
        k = int(after_tree)
        self.between[k] = _running_mean(self.between[k], ms)

    def observe_host(self, ms_per_request: float) -> None:
        """The host's time to compose one request's tree, measured by the engine after each step that composed."""
        self.host_ms = _running_mean(self.host_ms, ms_per_request)

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

    def step_costs(self) -> StepCosts:
        """The costs as measured now: the cost model, its running scales and the host's times."""
        return StepCosts(self.costs, tuple(self.step_scale), self.host_ms, tuple(self.between), tuple(self.switch))

    def decide(self, cands: list[Candidate], can_draft: bool) -> StepDecision:
        """The step for these decoding requests (the function `decide`, on the costs as measured now); the policy's
        state moves on."""
        d, self.state = decide(self.state, cands, can_draft, self.step_costs(), self.widths, self.fixed_width(),
                               self.beam_options, self.depth_options)
        return d
