"""Timing decode runs on an engine in this process, shared by `trt-redrafter bench-engine` and scripts/gpu_bench.py.

    run_mode        one mode (ar, or a proposer's speculation) over a list of prompts: each request's TPOT, and the
                    decode steps as the engine timed them (`Engine.step_times`)
    phase_profile   the phase breakdown of ReDrafter steps (`Engine.timer`: each phase its own unit, timed alone)
    round_schedule  the order an offline benchmark runs its modes in: every mode on every prompt group, the order
                    rotating from group to group and round to round
    RatioSummary    a ratio measured once per round: its median and how far the rounds disagree

Under TP these run on the driver rank while the others `follow` (runtime/scheduler.py); `last=False` keeps them
following between runs, and `runtime.generate.release_followers` ends them.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Optional

from ..config import SamplingConfig, Speculation
from ..runtime.engine import Engine
from ..runtime.generate import GenerationResult, generate, release_followers
from .metrics import percentile


@dataclass
class ModeRun:
    """One mode's run over a list of prompts, batched together."""

    mode: str  # "ar" or a proposer's name ("redrafter", "ngram", "mixed")
    results: list[GenerationResult]
    decode_s: float  # every decode step of the run, the AR steps a speculating request took included
    decode_steps: int
    own_step_ms: float  # mean step of the mode's own kind: tree steps for a proposer, AR steps for ar (0: none)
    propose_s: float  # the host's drafting between steps (N-gram, mixed)
    widths: dict[int, int] = field(default_factory=dict)  # decode steps by verified tree nodes (0: AR)
    beams: dict[int, int] = field(default_factory=dict)  # tree steps that drafted, by beams searched
    depths: dict[int, int] = field(default_factory=dict)  # ... and by the depth drafted

    @property
    def tpot_ms(self) -> float:
        """The median over requests of each request's TPOT."""
        return statistics.median(r.ms_per_token for r in self.results)

    @property
    def outputs(self) -> list[list[int]]:
        return [r.output_ids for r in self.results]

    @property
    def tokens_per_step(self) -> float:
        return 1.0 if self.mode == "ar" else statistics.mean(r.tokens_per_step for r in self.results)

    @property
    def decode_step_ms(self) -> float:
        return 1e3 * self.decode_s / max(1, self.decode_steps)


def decoding_mode(mode: str) -> tuple[str, Optional[str]]:
    """A benchmark's mode as `generate` takes it: (decoding mode, proposer)."""
    return ("ar", None) if mode == "ar" else ("redrafter", mode)


def run_mode(engine: Engine, prompts: list[list[int]], params: SamplingConfig, mode: str,
             last: bool = True) -> ModeRun:
    """Decode `prompts` together in `mode`, greedy as `params` says; `last=False` under a benchmark's many runs."""
    engine.step_times.reset()
    decoding, proposer = decoding_mode(mode)
    res = generate(engine, prompts, params, decoding, proposer=proposer, last=last)
    st = engine.step_times  # an N-gram request with nothing worth drafting takes an AR step
    return ModeRun(mode, res, st.seconds["ar"] + st.seconds["tree"], st.steps["ar"] + st.steps["tree"],
                   st.mean_ms("ar" if decoding == "ar" else "tree"), st.seconds["propose"], dict(st.widths),
                   dict(st.beams), dict(st.depths))


def phase_profile(engine: Engine, prompts: list[list[int]], params: SamplingConfig, proposer: str = "redrafter",
                  last: bool = True) -> tuple[dict[str, float], str]:
    """Mean ms per ReDrafter step of each phase (verify, accept, rewind, draft, pack), each run as its own unit and
    timed with the device synchronized around it, and the speculation the timed steps ran under. First under the
    engine's own; where its policy took AR steps only (a drafter that does not pay on this machine: no tree step to
    time), again with every tree verified whole (`full`). The first run of each builds those units and is not
    counted."""
    policy = engine.policy
    own = policy.speculation
    engine.timer.enabled = True
    try:
        # the timed phases' steps are not the decode as it runs: the policy's scales and host times stay the decode's
        with policy.observations_kept():
            for speculation in dict.fromkeys((own, Speculation(False))):
                policy.speculation = speculation
                generate(engine, prompts, params, "redrafter", proposer=proposer, last=False)
                engine.timer.reset()
                generate(engine, prompts, params, "redrafter", proposer=proposer, last=False)
                if engine.timer.steps:
                    return engine.timer.mean_ms(), str(speculation)
        return {}, str(own)
    finally:
        engine.timer.enabled = False
        policy.speculation = own
        if last:
            release_followers(engine)


def round_schedule(modes: list[str], groups: int, rounds: int) -> list[list[list[str]]]:
    """[round][group] -> the modes in the order they run on that group. The order is rotated by one from each group
    to the next and from each round to the next (with two modes: AR first, then second, alternately, in both
    directions), so a slow phase of the machine, which lasts seconds, falls on every mode alike, and no mode is
    always the one that runs first after another group's work."""
    n = len(modes)
    return [[modes[(r + g) % n:] + modes[:(r + g) % n] for g in range(groups)] for r in range(rounds)]


@dataclass
class RatioSummary:
    """A ratio measured once per round (a mode's speedup over AR): the median is the headline, the spread says how
    far to trust it."""

    median: float
    min: float
    max: float
    q1: float  # 25th and 75th percentiles (linear interpolation, numpy's default)
    q3: float
    rounds: int

    @classmethod
    def of(cls, ratios: list[float]) -> "RatioSummary":
        assert ratios, "a ratio summary needs at least one round"
        xs = sorted(ratios)
        return cls(statistics.median(xs), xs[0], xs[-1], percentile(xs, 25), percentile(xs, 75), len(xs))

    @property
    def iqr(self) -> float:
        return self.q3 - self.q1

    @property
    def straddles_one(self) -> bool:
        """Some rounds found the mode faster than AR and others slower: the median alone is not a verdict."""
        return self.min < 1.0 < self.max

    def describe(self) -> str:
        """E.g. '1.32x (rounds 1.25-1.40, IQR 0.05, n=5)'."""
        return (f"{self.median:.2f}x (rounds {self.min:.2f}-{self.max:.2f}, IQR {self.iqr:.2f}, n={self.rounds})"
                + ("; the rounds disagree on which is faster" if self.straddles_one else ""))

