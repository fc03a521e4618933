"""A proposer that knows each request's greedy continuation and drafts it at a set acceptance (benchmarks and tests).

A random model's drafter is almost always wrong, so neither a benchmark of a model built in place nor a test of
verify/accept/rewind sees long acceptances from it. This proposer drafts the known AR continuation instead, kept
token by token with probability p (a geometric acceptance: a full tree then emits 1 + p + ... + p^dl tokens per step
on average), and, with `corrupt_every=k`, wrong at a random depth on every k-th tree (partial acceptances on a
schedule). Its other beams branch off at random depths with random tokens, so every step verifies a real tree.
"""

from __future__ import annotations

import math
import random
from typing import Hashable, Mapping, Optional

import torch

from ..runtime.proposer import Proposer
from ..runtime.sequence import Draft
from ..runtime.step import SCORE_FLOOR, quantize_scores

POOL_TOKENS = 4096  # random tokens drawn once; a tree takes a window of them (cheap on the host at any batch)
FIRST_TOKEN = 3  # random tokens avoid the special ids 0-2 (pad, BOS, EOS in Llama's vocabulary)


def per_token_acceptance(tokens_per_step: float, dl: int) -> float:
    """p such that a beam whose every drafted token is accepted with probability p (given its prefix was) emits
    1 + p + p^2 + ... + p^dl tokens per step on average."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid ** j for j in range(dl + 1)) < tokens_per_step else (lo, mid)
    return (lo + hi) / 2


class ContinuationOracle(Proposer):
    """Drafts `continuations[key(seq)]` (the request's full greedy AR output) as one beam of every tree.

    key: "seq_id" (the request's id: `generate` numbers its prompts from 0) or "prompt" (the prompt's token ids).
    tokens_per_step: the mean a full tree should emit (None: every drafted token right, p = 1).
    corrupt_every: every k-th tree has its oracle beam wrong at a random depth (0: never).
    Scores are calibrated: the oracle's node at depth j scores log(p^j) (0, certain, at p = 1; it does not know
    where a corruption lies), a random node log(1 / V) per random token on its path.
    """

    name = "oracle"
    on_host = True

    def __init__(self, num_beams: int, draft_len: int, vocab: int, continuations: Mapping[Hashable, list[int]],
                 key: str = "seq_id", tokens_per_step: Optional[float] = None, corrupt_every: int = 0,
                 seed: int = 0):
        assert key in ("seq_id", "prompt"), key
        self.num_beams, self.draft_len, self.vocab = num_beams, draft_len, vocab
        self.continuations, self.key, self.corrupt_every = continuations, key, corrupt_every
        self.p = 1.0 if tokens_per_step is None else max(per_token_acceptance(tokens_per_step, draft_len), 1e-6)
        self.rng = random.Random(seed)
        self.calls = 0
        nb, dl = num_beams, draft_len
        self.hit = [int(quantize_scores(torch.tensor(j * math.log(self.p))).item()) for j in range(dl + 1)]
        miss = int(quantize_scores(torch.tensor(-math.log(vocab))).item())
        # scores of a branch that leaves the oracle's path after d drafted tokens, at depths d+1..dl
        self.branch = [[max(SCORE_FLOOR, self.hit[d] + (j - d + 1) * miss) for j in range(d, dl)] for d in range(dl)]
        self.pool = [self.rng.randrange(FIRST_TOKEN, vocab) for _ in range(POOL_TOKENS + nb * dl)]

    def known(self, seq) -> list[int]:
        """The continuation still ahead of `seq` (empty when the oracle was not told this request's)."""
        k = seq.seq_id if self.key == "seq_id" else tuple(seq.prompt)
        return self.continuations.get(k, [])[len(seq.output):]

    def compose(self, seq, device: Optional[Draft] = None) -> Draft:
        nb, dl, rng, pool = self.num_beams, self.draft_len, self.rng, self.pool
        known = self.known(seq)
        k = rng.randrange(len(pool) - nb * dl)  # this tree's random tokens: a window of the pool
        oracle = pool[k:k + dl]
        for j in range(min(dl, len(known))):
            if self.p < 1.0 and rng.random() >= self.p:
                break  # the first miss: a random token here and after
            oracle[j] = known[j]
        self.calls += 1
        if self.corrupt_every and self.calls % self.corrupt_every == 0:
            d = rng.randrange(dl)
            oracle[d] = (oracle[d] + 1) % self.vocab
        rows, scores = [], []
        for i in range(1, nb):
            d = rng.randrange(dl)  # shares the oracle's first d drafted tokens, then random ones
            rows.append([seq.true_token] + oracle[:d] + pool[k + i * dl + d:k + (i + 1) * dl])
            scores.append(self.hit[1:d + 1] + self.branch[d])
        at = rng.randrange(nb)  # anywhere among the beams, so the accepted beam is not always the first
        rows.insert(at, [seq.true_token] + oracle)
        scores.insert(at, self.hit[1:])
        return Draft(rows, scores)
