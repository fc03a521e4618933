"""The speculation policy: how much of each draft tree a step verifies, down to none.

A tree is worth verifying only where the tokens it is expected to add pay for what verifying it adds to the step.
Both sides are measured, not assumed:

    CostModel    step time by batch size and verified tree nodes T, measured on this machine for this engine (its
                 device, dtype, kernels, linear layers, compile mode and threads) at two context lengths, and cached
                 beside the engine: `ar` (an AR step) and `tree` (a step that verifies T nodes of every request's tree
                 and drafts the next trees). The steps as they run scale it: each kind's running ratio of measured
                 to modelled time (`Policy.observe_step`), since a machine's speed moves in phases (a shared host's
                 memory bandwidth) and a memory-bound AR step moves more than a tree step.
    Calibration  P(a drafted node is accepted | the proposer's score for it), learned from every verified node's
                 outcome, per proposer and acceptance rule. A node's score is its proposer's confidence in the whole
                 path to it (ReDrafter: the drafter's log-probability of the beam prefix, which its beam search
                 computes anyway); the expected tokens a tree adds are the sum of its nodes' acceptance probabilities,
                 EAGLE-2's argument: a node adds a token exactly when its whole path is accepted.
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

import bisect
import hashlib
import itertools
import json
import math
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Hashable, Iterable, Optional

from ..log import get_logger
from .step import SCORE_SCALE

logger = get_logger(__name__)

COST_MODEL_FILE = "cost_model.json"
COST_MODEL_VERSION = 1
PROBE_MIN, PROBE_MAX = 4, 64  # AR steps between probes while resting (doubling while probes find nothing)
PROBE_HOPE = 0.95  # probe sooner than PROBE_MAX only where the last trees, drafted again, would nearly pay
MEAN_DECAY = 0.8  # running means of a drafting step's gain and cost: weight of the past
# the cost model, measured once, against the steps as they run now: a running mean (weight of the past) of each kind's
# measured / modelled step time, each observation clamped to [1 / STEP_SCALE_CLAMP, STEP_SCALE_CLAMP]
STEP_SCALE_DECAY, STEP_SCALE_CLAMP = 0.9, 2.0

# calibration: bins of a node's score (log-probability), best first; the prior is the score itself (a calibrated
# drafter), worth PRIOR_WEIGHT observations; old outcomes fade by DECAY per step, so a drafter that starts or stops
# fitting the text is followed, and a stale pessimism gives way to the prior again
SCORE_BINS = (-0.1, -0.25, -0.5, -0.75, -1.0, -1.5, -2.0, -3.0, -4.5)
PRIOR_WEIGHT = 8.0  # per bin; and the overall trust starts as TRUST_WEIGHT claimed-and-accepted nodes
TRUST_WEIGHT = 8.0
DECAY = 0.998


def tree_buckets(max_tree_tokens: int) -> list[int]:
    """Tree widths a step may verify: 1 (the root: a probe), 2, 3, 5, 9, 17, ... (1 + powers of two) and the whole
    tree. Few, so that CUDA graphs capture each; spaced so that the next bucket roughly doubles the drafted nodes."""
    out, k = [1], 1
    while 1 + k < max_tree_tokens:
        out.append(1 + k)
        k *= 2
    return out + [max_tree_tokens] if max_tree_tokens > 1 else out


# ---- the cost model -----------------------------------------------------------------------------------------------

@dataclass
class CostModel:
    """Measured step times (ms): `ar[b]` and `tree[b][T]` at context lengths `contexts` (two), for the batch sizes
    `batches` (the engine's buckets). Lookups interpolate linearly between measured batch sizes and contexts (and
    extrapolate past the longer context)."""

    batches: list[int]
    widths: list[int]
    contexts: list[int]
    ar: list[list[float]]  # [context][batch]
    tree: list[list[list[float]]]  # [context][batch][width]
    key: dict = field(default_factory=dict)  # what it was measured for (`fingerprint`)

    def ar_ms(self, batch: int, context: float) -> float:
        return self._lookup([row for row in self.ar], batch, context)

    def tree_ms(self, batch: int, width: int, context: float) -> float:
        w = self.widths.index(width)
        return self._lookup([[per_b[w] for per_b in row] for row in self.tree], batch, context)

    def _lookup(self, table: list[list[float]], batch: int, context: float) -> float:
        at_ctx = [_interp(self.batches, row, batch) for row in table]
        (c0, c1), (v0, v1) = self.contexts, at_ctx
        return max(v0 + (v1 - v0) * (context - c0) / (c1 - c0), min(v0, v1) * 0.5)

    def to_dict(self) -> dict:
        return {"batches": self.batches, "widths": self.widths, "contexts": self.contexts, "ar": self.ar,
                "tree": self.tree, "key": self.key}

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        return cls(d["batches"], d["widths"], d["contexts"], d["ar"], d["tree"], d.get("key", {}))

    def table(self) -> str:
        """The measurement as a markdown table: ms per step by batch and width, at each context."""
        lines = []
        for c, ctx in enumerate(self.contexts):
            lines.append(f"step ms at context {ctx}: | batch | AR | " + " | ".join(f"T={w}" for w in self.widths) +
                         " |")
            for b, bs in enumerate(self.batches):
                lines.append(f"| {bs} | {self.ar[c][b]:.2f} | " +
                             " | ".join(f"{x:.2f}" for x in self.tree[c][b]) + " |")
        return "\n".join(lines)


def _interp(xs: list[int], ys: list[float], x: float) -> float:
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1] * x / xs[-1]  # past the largest measured batch: proportional (compute-bound)
    i = bisect.bisect_left(xs, x)
    if xs[i] == x:
        return ys[i]
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def fingerprint(**parts) -> dict:
    """What a cost model depends on besides the engine's weights: the machine, how the engine runs, and the sources
    of the step's own kernels (a changed kernel changes the step's costs)."""
    import torch

    device = parts.pop("device")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = _cpu_name()
    return {"version": COST_MODEL_VERSION, "device": name, "torch": torch.__version__,
            "kernel_sources": kernel_sources_digest(), **parts}


def kernel_sources_digest(roots: Optional[Iterable[Path]] = None) -> str:
    """A digest of the step kernels' sources: the CPU kernels (cpu/*.cpp, *.h), the Triton kernels (plugins/*.py)
    and the compile options (runtime/graphs.py) of this installed copy."""
    pkg = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    files = [] if roots else [Path(__file__).with_name("graphs.py")]
    for root in roots or (pkg / "cpu", pkg / "plugins"):
        files += sorted(p for ext in ("*.cpp", "*.h", "*.py") for p in Path(root).glob(ext))
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() + f" x{os.cpu_count()}"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} x{os.cpu_count()}"


def cost_cache_paths(engine_dir: Optional[Path]) -> list[Path]:
    """Where a cost model is looked up and written: beside the engine, else the user's cache (an engine directory
    may be read-only, e.g. mounted into a container)."""
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trt-redrafter" / "cost-models"
    out = []
    if engine_dir is not None:
        out.append(engine_dir / COST_MODEL_FILE)
        ident = hashlib.sha256(str(engine_dir.resolve()).encode()).hexdigest()[:16]
        out.append(home / f"{ident}.json")
    return out


def _key_id(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def load_cost_model(paths: Iterable[Path], key: dict) -> Optional[CostModel]:
    kid = _key_id(key)
    for path in paths:
        try:
            entries = json.loads(path.read_text()).get("entries", {})
        except (OSError, ValueError, AttributeError):
            continue
        if kid in entries:
            try:
                return CostModel.from_dict(entries[kid])
            except (KeyError, TypeError):
                continue
    return None


def save_cost_model(paths: Iterable[Path], model: CostModel) -> Optional[Path]:
    """Add `model` to the first writable cache file (written under a temporary name, then renamed)."""
    kid = _key_id(model.key)
    for path in paths:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                doc = json.loads(path.read_text())
                if not isinstance(doc.get("entries"), dict):
                    raise ValueError
            except (OSError, ValueError, AttributeError):
                doc = {"entries": {}}
            doc["entries"][kid] = model.to_dict()
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(doc, indent=1))
            tmp.replace(path)
            return path
        except OSError:
            continue
    return None


# ---- calibration --------------------------------------------------------------------------------------------------

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
        self._table: Optional[tuple[list[Optional[float]], float]] = None
        self._age = 0  # steps whose DECAY is not applied yet (applied when the counts are next read or added to)

    def _settle(self) -> None:
        if self._age:
            f = DECAY ** self._age
            for arr in (self.accepted, self.verified, self.claimed):
                for i in range(len(arr)):
                    arr[i] *= f
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

    def probability(self, score: int) -> float:
        table, trust = self._table if self._table is not None and not self._age else self._probabilities()
        p = table[bisect.bisect_left(self._EDGES, -score)]
        return min(1.0, math.exp(score / SCORE_SCALE) * trust) if p is None else p

    def observe(self, verified: list[int], accepted: list[int]) -> None:
        """One step's outcome for one request: the scores of the drafted nodes it verified and of those accepted."""
        self._settle()
        edges, find = self._EDGES, bisect.bisect_left
        for s in verified:
            i = find(edges, -s)
            self.verified[i] += 1.0
            self.claimed[i] += math.exp(s / SCORE_SCALE)
        for s in accepted:
            self.accepted[find(edges, -s)] += 1.0
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
    """Chooses each step's StepDecision. `mode`: auto (the cost model), full (every tree whole, every step: what
    TensorRT-LLM does) or an integer T (the T best nodes of every tree, every step)."""

    def __init__(self, mode: str, max_tree_tokens: int, costs=None):
        self.mode = mode
        self.P = max_tree_tokens
        self.widths = tree_buckets(max_tree_tokens)
        self._costs = costs  # CostModel, or a callable that measures one the first time it is needed
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
        if self.mode != "auto" or callable(self._costs) or self._costs is None:
            return
        if decision.is_tree and not decision.draft:
            return
        k = int(decision.is_tree)
        switched, self._last_kind = self._last_kind != k, k
        if switched:
            # the first step of a kind after the other kind (a probe among AR steps, an AR step after trees) finds
            # its graph's code and weights out of cache: a cost that a run of such steps, which the cost model
            # times and the policy weighs, does not pay (models/small: probes took 1.6x a run's tree steps and
            # kept the policy from trees that paid)
            return
        model = self._costs.tree_ms(batch, decision.width, context) if decision.is_tree else \
            self._costs.ar_ms(batch, context)
        ratio = min(max(ms / model, 1 / STEP_SCALE_CLAMP), STEP_SCALE_CLAMP)
        self.step_scale[k] = STEP_SCALE_DECAY * self.step_scale[k] + (1 - STEP_SCALE_DECAY) * ratio

    def observe_host(self, ms_per_request: float) -> None:
        """The host's time to compose one request's tree, measured by the engine after each step that composed."""
        self.host_ms = ms_per_request if self.host_ms == 0 else \
            MEAN_DECAY * self.host_ms + (1 - MEAN_DECAY) * ms_per_request

    @property
    def costs(self) -> CostModel:
        if callable(self._costs):
            self._costs = self._costs()
        return self._costs

    def calibration(self, proposer: str, greedy: bool) -> Calibration:
        key = (proposer, greedy)
        cal = self.calibrations.get(key)
        if cal is None:
            cal = self.calibrations[key] = Calibration()
        return cal

    def fixed_width(self) -> Optional[int]:
        if self.mode == "auto":
            return None
        return self.P if self.mode == "full" else min(int(self.mode), self.P)

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
