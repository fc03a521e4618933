"""Step timing: `StepTimes`, every decode step's wall time by kind; and per-phase step timing (the way Apple's reference
times generate_candidates / verify_candidates / accept_candidate_tokens): wall time around each phase, with the
device synchronized at both ends so a phase is charged for its own kernels only. Enabled by
`RuntimeConfig.profile_phases`; then each phase runs as its own compiled unit or CUDA graph (launch.py), so the
breakdown describes the same kernels a fused step runs, plus one launch and one sync per phase.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch


class PhaseTimer:
    """Per-phase wall time, summed over the steps counted. A step during which some phase's unit compiled or captured
    a graph (a shape first seen: `discard_step`) is not counted: its time is the compiler's, not the phase's."""

    def __init__(self, device: torch.device, enabled: bool = False):
        self.device, self.enabled = device, enabled
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps = 0
        self.discarded = 0  # steps not counted: a phase's unit was built during them
        self._step: dict[str, float] = defaultdict(float)
        self._discard = False

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def phase(self, name: str):
        self._sync()
        t0 = time.perf_counter()
        yield
        self._sync()
        self._step[name] += time.perf_counter() - t0

    @contextlib.contextmanager
    def paused(self):
        """Steps run fused and untimed within: what the step cost model measures is the step every run takes, not
        the phases' separate units (which a model cached beside the engine would then carry into runs without
        them)."""
        enabled, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = enabled

    def discard_step(self) -> None:
        self._discard = True

    def end_step(self) -> None:
        if self._discard:
            self.discarded += 1
        else:
            for k, v in self._step.items():
                self.seconds[k] += v
            self.steps += 1
        self._step.clear()
        self._discard = False

    def mean_ms(self) -> dict[str, float]:
        """Phase -> mean milliseconds per step."""
        return {k: 1e3 * v / self.steps for k, v in self.seconds.items()} if self.steps else {}

    def reset(self) -> None:
        self.seconds.clear()
        self.steps = self.discarded = 0
        self._step.clear()
        self._discard = False


@dataclass
class StepTimes:
    """Wall time of decode steps by kind ("ar", "tree"; launch to read-back, host bookkeeping excluded), for cost
    ratios; and under "propose" the host's drafting between steps (N-gram proposer, mixed trees)."""

    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    steps: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    widths: dict[int, int] = field(default_factory=lambda: defaultdict(int))  # decode steps by verified width (0: AR)
    beams: dict[int, int] = field(default_factory=lambda: defaultdict(int))  # drafting tree steps by beams searched
    depths: dict[int, int] = field(default_factory=lambda: defaultdict(int))  # ... and by the depth drafted

    def add(self, kind: str, seconds: float) -> None:
        self.seconds[kind] += seconds
        self.steps[kind] += 1

    def mean_ms(self, kind: str) -> float:
        return 1e3 * self.seconds[kind] / self.steps[kind] if self.steps[kind] else 0.0

    def reset(self) -> None:
        self.seconds.clear()
        self.steps.clear()
        self.widths.clear()
        self.beams.clear()
        self.depths.clear()
