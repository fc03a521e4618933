"""Log-probabilities of emitted tokens: computed on the device inside a step, read back with its one host sync.

Which distribution: the base model's own, `log_softmax` of the raw logits at the token's position, before
temperature, top-k and top-p (vLLM's default `logprobs_mode="raw_logprobs"`; Hugging Face's `compute_transition_scores`
on the model's logits). So a token's log-probability is the same number whatever the request's sampling parameters,
and with speculation it is the verify pass's: the base model scores every tree node at exactly the position and context
an AR step would score it, so an accepted token reports what AR decoding reports.

A step returns int64 rows (step.RowLayout); log-probabilities travel in them as fixed point, round(lp * 2**32):
exact for a float32 log-probability of magnitude >= 2**-8 and within 2**-33 below that, and the same integer on every
rank and under every compile mode. Per emitted token, 1 + 2K columns: its log-probability, then the K most likely
tokens' ids, then their log-probabilities (most likely first).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE = float(1 << 32)  # fixed-point scale of a log-probability in a step row
FLOOR = -1.0e6  # log-probabilities are clamped here (log_softmax of a -inf logit would be -inf, not a JSON number)


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability under the base model, and the `top` most likely tokens there
    ((token id, log-probability), most likely first; as many as the request asked for)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def columns(k: int) -> int:
    """Row columns per emitted token with top-`k` log-probabilities."""
    return 1 + 2 * k


def encode(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """logits [bs, n, V] (the distribution each of tokens [bs, n] was chosen from) -> [bs, n * (1 + 2k)] int64 rows:
    per token its log-probability, the k most likely ids and theirs (fixed point, `SCALE`)."""
    bs, n, _ = logits.shape
    logp = torch.log_softmax(logits.float(), dim=-1).clamp(min=FLOOR)  # [bs, n, V]
    chosen = logp.gather(-1, tokens[..., None])  # [bs, n, 1]
    top, ids = logp.topk(k, dim=-1)  # [bs, n, k]
    fixed = lambda x: (x * SCALE).round().long()  # noqa: E731
    return torch.cat([fixed(chosen), ids, fixed(top)], dim=-1).reshape(bs, n * columns(k))


def decode(cols: list[int], n: int, k: int, want: int) -> list[TokenLogprob]:
    """The first n tokens' log-probabilities from a row's log-probability columns (`encode`), each with its `want`
    (<= k) most likely tokens."""
    w = columns(k)
    out = []
    for i in range(n):
        c = cols[i * w:(i + 1) * w]
        top = tuple((c[1 + j], c[1 + k + j] / SCALE) for j in range(want))
        out.append(TokenLogprob(c[0] / SCALE, top))
    return out
