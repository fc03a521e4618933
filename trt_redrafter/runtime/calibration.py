"""How far a proposer's confidence holds: P(a drafted node is accepted | the proposer's score for it, its depth),
learned from every verified node's outcome, per proposer and acceptance rule (the policy keeps one per pair). A node's
score is its proposer's confidence in the whole path to it (ReDrafter: the drafter's log-probability of the beam
prefix, which its beam search computes anyway); the expected tokens a tree adds are the sum of its nodes' acceptance
probabilities, EAGLE-2's argument: a node adds a token exactly when its whole path is accepted.

Depth counts besides the score: a drafter's errors compound along a path, so of two nodes it scores alike the deeper
is accepted less (SmolLM2's drafter, score 0.5-0.6: 56% at depth 1, 0% at depth 4). A tree of one beam is a chain
of deep nodes, one of four beams has shallow siblings; calibrated by score alone, the chain's worth was overrated by
about 10% (docs/perf-history.md). So each (score bin, depth) cell learns its own rate, starting from its bin's."""

from __future__ import annotations

import bisect
import math
from typing import Optional

from .step import SCORE_SCALE

# calibration: bins of a node's score (log-probability), best first; the prior is the score itself (a calibrated
# drafter), worth PRIOR_WEIGHT observations; old outcomes fade by DECAY per step, so a drafter that starts or stops
# fitting the text is followed, and a stale pessimism gives way to the prior again
SCORE_BINS = (-0.1, -0.25, -0.5, -0.75, -1.0, -1.5, -2.0, -3.0, -4.5)
PRIOR_WEIGHT = 8.0  # per bin; and the overall trust starts as TRUST_WEIGHT claimed-and-accepted nodes
TRUST_WEIGHT = 8.0
DECAY = 0.998
MAX_DEPTH = 16  # deeper nodes share the last depth's cells


class Calibration:
    """P(accepted | score bin): (accepted + PRIOR_WEIGHT * prior) / (verified + PRIOR_WEIGHT) per bin. The prior of a
    bin is what the proposer claimed there (its mean probability), scaled by how far its claims have held overall
    (all accepted / all claimed, itself starting at 1): a drafter found overconfident in some bins is trusted less in
    the bins it has not been seen in yet.

    The policy asks for every node of every request each step (64 requests x 25 nodes at batch 64), so the per-bin
    probabilities are computed once after each change and a node's lookup is a bisection and an index."""

    # SCORE_BINS as quantized scores, negated so that they ascend: a score's bin is the first edge it reaches
    _EDGES = [-round(edge * SCORE_SCALE) for edge in SCORE_BINS]

    def __init__(self):
        n = len(SCORE_BINS) + 1
        self.accepted, self.verified, self.claimed = [0.0] * n, [0.0] * n, [0.0] * n
        # per (bin, depth - 1): the same counts of the nodes at that depth (accepted, verified)
        self.cells = [[[0.0, 0.0] for _ in range(MAX_DEPTH)] for _ in range(n)]
        self._table: Optional[tuple[list[Optional[float]], float]] = None
        self._age = 0  # steps whose DECAY is not applied yet (applied when the counts are next read or added to)

    def _settle(self) -> None:
        if self._age:
            f = DECAY ** self._age
            for arr in (self.accepted, self.verified, self.claimed):
                for i in range(len(arr)):
                    arr[i] *= f
            for row in self.cells:
                for cell in row:
                    if cell[1]:
                        cell[0] *= f
                        cell[1] *= f
            self._age, self._table = 0, None

    @staticmethod
    def bin(score: int) -> int:
        """Bin of a quantized score (step.quantize_scores): 0 = most confident."""
        return bisect.bisect_left(Calibration._EDGES, -score)

    def trust(self) -> float:
        """All accepted / all claimed, with TRUST_WEIGHT claimed-and-accepted nodes as its prior."""
        self._settle()
        return (sum(self.accepted) + TRUST_WEIGHT) / (sum(self.claimed) + TRUST_WEIGHT)

    def _probabilities(self) -> tuple[list[Optional[float]], float]:
        """(per bin: P(accepted), or None for a bin never verified, whose prior is each node's own claim; trust)."""
        self._settle()
        if self._table is None:
            trust, table = self.trust(), []
            for a, v, c in zip(self.accepted, self.verified, self.claimed):
                table.append((a + PRIOR_WEIGHT * min(1.0, c / v * trust)) / (v + PRIOR_WEIGHT) if v > 0 else None)
            self._table = (table, trust)
        return self._table

    def probability(self, score: int, depth: int = 0) -> float:
        """P(accepted) of a node of this score at this depth (0: any depth, the bin's rate): the cell's outcomes,
        with PRIOR_WEIGHT observations of its bin's rate as the prior."""
        table, trust = self._table if self._table is not None and not self._age else self._probabilities()
        i = bisect.bisect_left(self._EDGES, -score)
        p = table[i]
        p = min(1.0, math.exp(score / SCORE_SCALE) * trust) if p is None else p
        if depth:
            a, v = self.cells[i][min(depth, MAX_DEPTH) - 1]
            if v:
                return (a + PRIOR_WEIGHT * p) / (v + PRIOR_WEIGHT)
        return p

    def observe(self, verified: list[int], accepted: list[int], verified_depths: Optional[list[int]] = None,
                accepted_depths: Optional[list[int]] = None) -> None:
        """One step's outcome for one request: the scores of the drafted nodes it verified and of those accepted,
        and their depths where known (the (bin, depth) cells learn from those)."""
        self._settle()
        edges, find = self._EDGES, bisect.bisect_left
        for j, s in enumerate(verified):
            i = find(edges, -s)
            self.verified[i] += 1.0
            self.claimed[i] += math.exp(s / SCORE_SCALE)
            if verified_depths:
                self.cells[i][min(verified_depths[j], MAX_DEPTH) - 1][1] += 1.0
        for j, s in enumerate(accepted):
            i = find(edges, -s)
            self.accepted[i] += 1.0
            if accepted_depths:
                self.cells[i][min(accepted_depths[j], MAX_DEPTH) - 1][0] += 1.0
        self._table = None

    def decay(self) -> None:
        """One step passed: old outcomes fade by DECAY (applied lazily: a resting policy reads nothing)."""
        self._age += 1

    def summary(self) -> list[dict]:
        """Per bin: the claimed probability, the observed acceptance, and the observations (decayed counts)."""
        self._settle()
        out = []
        for i in range(len(self.verified)):
            n = self.verified[i]
            out.append({"bin": i, "claimed": self.claimed[i] / n if n else None,
                        "accepted": self.accepted[i] / n if n else None, "verified": n})
        return out
