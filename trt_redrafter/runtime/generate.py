"""Offline generation: run a list of requests to completion, at most `max_batch_size` at a time (first come,
first served; a finished request's slot and KV blocks go to the next waiting one between steps)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..config import SamplingConfig
from .engine import Engine
from .sequence import Sequence


@dataclass
class GenerationResult:
    prompt: list[int]
    output_ids: list[int]
    finish_reason: str
    steps: int
    tokens_per_step: float
    accepted_draft_tokens: int
    draft_tokens: int
    ttft_ms: float
    ms_per_token: float  # TPOT: (end - first token) / (output tokens - 1)

    @classmethod
    def of(cls, s: Sequence) -> "GenerationResult":
        st = s.stats
        n = len(s.output)
        tpot = (st.finish_time - st.first_token_time) * 1e3 / (n - 1) if n > 1 else 0.0
        return cls(s.prompt, list(s.output), s.finish_reason or "", st.steps, st.tokens_per_step,
                   st.accepted_draft_tokens, st.draft_tokens, (st.first_token_time - st.arrival) * 1e3, tpot)


def generate(engine: Engine, prompts: list[list[int]], params: SamplingConfig | list[SamplingConfig],
             mode: str = "redrafter", stop_ids: tuple[int, ...] = ()) -> list[GenerationResult]:
    if isinstance(params, SamplingConfig):
        params = [params] * len(prompts)
    waiting = deque(engine.new_sequence(p, sp, mode, stop_ids) for p, sp in zip(prompts, params))
    order = [s.seq_id for s in waiting]
    running: list[Sequence] = []
    done: dict[int, Sequence] = {}
    while waiting or running:
        while waiting and len(running) < engine.build.max_batch_size:
            running.append(waiting.popleft())
        engine.step(running)
        for s in [s for s in running if s.finished]:
            engine.release(s)
            done[s.seq_id] = s
        running = [s for s in running if not s.finished]
    return [GenerationResult.of(done[i]) for i in order]
