"""Per-request timings -> per-point serving metrics, defined as vLLM's `benchmark_serving.py` defines them.

Glossary (all times client-side, from the moment a request is sent; one request = one gRPC stream):
    TTFT    time to the first response that carries tokens
    E2E     time to the last response with tokens (end-to-end latency)
    TPOT    per request (E2E - TTFT) / (output tokens - 1): "ms/token", the number the project compares.
            Requests with fewer than 2 output tokens have no TPOT.
    ITL     gaps between consecutive token-bearing responses, pooled over all requests (vLLM's ITL). With
            speculation one response carries several tokens, so ITL goes up when TPOT goes down: report it,
            never compare AR and ReDrafter on it.
    tokens/step   output tokens after the first / generation steps (trtllm-bench's acceptance length). The
            first token comes from the prompt step; every later streamed response is one engine step.
    acceptance rate   accepted draft tokens / drafted tokens (dl per step), from the server's final response.

Aggregates across requests: mean, median, p90, p99 with linear interpolation (numpy's default, as vLLM uses).
Throughputs divide by the measured window: first measured send to last measured completion.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """One request's outcome, reduced to what the metrics need (all times in seconds since it was sent)."""

    index: int  # position in the point's schedule (warm-up requests come first)
    scheduled_s: float  # planned arrival, seconds after the point started
    sent_s: float  # actual send time, seconds after the point started
    chunk_times: list[float] = field(default_factory=list)  # token-bearing responses only
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in each of those responses
    accepted_draft_tokens: int = 0
    draft_tokens: int = 0
    error: Optional[str] = None
    warmup: bool = False

    @property
    def output_tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def ttft_s(self) -> Optional[float]:
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def e2e_s(self) -> Optional[float]:
        return self.chunk_times[-1] if self.chunk_times else None

    @property
    def tpot_s(self) -> Optional[float]:
        n = self.output_tokens
        if self.error is not None or n < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (n - 1)

    @property
    def itls_s(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def steps(self) -> int:
        """Generation steps after the prompt step (one streamed response each)."""
        return max(len(self.chunk_times) - 1, 0)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RequestRecord":
        return cls(**d)


def percentile(xs: Sequence[float], q: float) -> Optional[float]:
    """numpy.percentile(xs, q) with linear interpolation; None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def distribution(xs: Sequence[float], scale: float = 1.0) -> dict:
    """{mean, median, p90, p99, n} of xs * scale (None-valued when xs is empty)."""
    ys = [x * scale for x in xs]
    out = {"mean": sum(ys) / len(ys) if ys else None}
    out.update({("median" if q == 50 else f"p{q}"): percentile(ys, q) for q in PERCENTILES})
    out["n"] = len(ys)
    return out


def summarize(records: Sequence[RequestRecord]) -> dict:
    """Metrics of one (mode, TP, QPS) point from its measured requests (warm-up records are skipped)."""
    measured = [r for r in records if not r.warmup]
    ok = [r for r in measured if r.error is None and r.chunk_times]
    errors = len(measured) - len(ok)
    if ok:
        start = min(r.sent_s for r in measured)
        end = max(r.sent_s + r.e2e_s for r in ok)
        window = end - start
    else:
        window = 0.0
    out_tokens = sum(r.output_tokens for r in ok)
    steps = sum(r.steps for r in ok)
    after_first = sum(r.output_tokens - r.chunk_tokens[0] for r in ok)
    drafted = sum(r.draft_tokens for r in ok)
    return {
        "completed": len(ok),
        "errors": errors,
        "error_samples": sorted({r.error for r in measured if r.error})[:3],
        "duration_s": window,
        "output_tokens": out_tokens,
        "request_throughput": len(ok) / window if window > 0 else None,  # requests/s
        "output_throughput": out_tokens / window if window > 0 else None,  # tokens/s
        "ttft_ms": distribution([r.ttft_s for r in ok], 1e3),
        "tpot_ms": distribution([r.tpot_s for r in ok if r.tpot_s is not None], 1e3),
        "itl_ms": distribution([x for r in ok for x in r.itls_s], 1e3),
        "e2e_ms": distribution([r.e2e_s for r in ok], 1e3),
        "tokens_per_step": after_first / steps if steps else None,
        "acceptance_rate": sum(r.accepted_draft_tokens for r in ok) / drafted if drafted else None,
        "send_lag_ms": distribution([r.sent_s - r.scheduled_s for r in measured], 1e3),  # client health check
    }


def median(xs: Sequence[Optional[float]]) -> Optional[float]:
    return percentile([x for x in xs if x is not None], 50)


def median_of_points(points: Sequence[dict]) -> dict:
    """Element-wise median of several repeats' metric dicts (same keys); counts (errors, completed) are summed."""
    assert points, "no repeats to combine"
    out: dict = {}
    for key, first in points[0].items():
        vals = [p.get(key) for p in points]
        if key in ("errors", "completed", "output_tokens"):
            out[key] = sum(v or 0 for v in vals)
        elif key == "error_samples":
            out[key] = sorted({e for v in vals for e in (v or [])})[:3]
        elif isinstance(first, dict):
            out[key] = median_of_points(vals)
        elif isinstance(first, (int, float)) or first is None:
            out[key] = median(vals)
        else:
            out[key] = first
    return out
