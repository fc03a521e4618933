"""Offline generation: run a list of requests to completion through the in-flight batching scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import Guide, SamplingConfig
from ..decoding.logprobs import TokenLogprob
from .engine import Engine
from .scheduler import Request, Scheduler
from .sequence import RequestSpec, Sequence


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
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (runtime/kv_cache.py)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of output_ids, where the request asked for them

    @classmethod
    def of(cls, s: Sequence) -> "GenerationResult":
        st = s.stats
        n = len(s.output)
        tpot = (st.finish_time - st.first_token_time) * 1e3 / (n - 1) if n > 1 else 0.0
        return cls(s.prompt, list(s.output), s.finish_reason or "", st.steps, st.tokens_per_step,
                   st.accepted_draft_tokens, st.draft_tokens, (st.first_token_time - st.arrival) * 1e3, tpot,
                   st.cached_tokens, list(s.output_logprobs))


def generate(engine: Engine, prompts: list[list[int]], params: SamplingConfig | list[SamplingConfig],
             mode: str = "redrafter", stop_ids: tuple[int, ...] = (), proposer: str | None = None,
             last: bool = True, guide: Guide | list[Guide | None] | None = None) -> list[GenerationResult]:
    """Run requests to completion through the in-flight scheduler (driver rank; followers run `follow`).
    `proposer` overrides the engine's default proposer for these requests; `guide`: the grammar their output
    follows (one for all, or one per prompt). `last=False` keeps the follower ranks
    in `follow` for more calls (a benchmark's many runs on one engine); the caller then ends them with
    `release_followers`."""
    if isinstance(params, SamplingConfig):
        params = [params] * len(prompts)
    guides = guide if isinstance(guide, list) else [guide] * len(prompts)
    sched = Scheduler(engine)
    reqs = [sched.submit(Request(i, RequestSpec(p, sp, mode, proposer, tuple(stop_ids), guide=g)))
            for i, (p, sp, g) in enumerate(zip(prompts, params, guides))]
    sched.run_until_idle()
    if last:
        release_followers(engine)
    return [GenerationResult.of(r.seq) for r in reqs]


def release_followers(engine: Engine) -> None:
    """End `follow` on the other TP ranks (a no-op at TP 1)."""
    engine.dist.broadcast_object(None)
