"""Target-model sampling: logits -> processed probabilities -> one token per request.

`process_logits` applies, in Hugging Face `generate`'s order and with its definitions, temperature
(`TemperatureLogitsWarper`), top-k (`TopKLogitsWarper`: drop tokens scoring below the k-th best, ties at the k-th
kept) and top-p (`TopPLogitsWarper`: drop the low tail whose cumulative mass is <= 1 - p, always keeping the most
likely token), then renormalizes. So AR sampling here draws from the same distribution as HF's, and the `exact`
acceptance rule, which samples from these probabilities at every tree node, does too.

Every request owns one `torch.Generator` (seeded from its `seed`), so its tokens do not depend on which other
requests share its batch.
"""

from __future__ import annotations

import torch

GREEDY_TEMPERATURE = 0.0  # a row with this temperature gets a one-hot argmax distribution


def process_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor) -> torch.Tensor:
    """logits [N, V] -> probabilities [N, V] float32, per row: temperature, then top-k (0: off), then top-p (1: off).

    Rows with temperature 0 get the one-hot distribution of their (first) argmax.
    """
    assert logits.dim() == 2, f"logits must be [N, V], got shape {tuple(logits.shape)}"
    N, V = logits.shape
    for name, t in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
        assert t.shape == (N,), f"{name} must be [N]=[{N}], got shape {tuple(t.shape)}"
    scores = logits.float()  # [N, V]
    greedy = temperature <= GREEDY_TEMPERATURE  # [N]
    temp = torch.where(greedy, 1.0, temperature.float()).to(scores.device)  # [N]
    scores = scores / temp[:, None]

    k_on = (top_k > 0).to(scores.device)  # [N]
    k_max = min(int(top_k.max()), V) if bool(k_on.any()) else V
    if bool(k_on.any()):
        # One topk of the largest k instead of a full sort of V.
        k = top_k.to(device=scores.device, dtype=torch.long).clamp(1, k_max)  # [N]
        kth = scores.topk(k_max, dim=-1).values.gather(1, (k - 1)[:, None])  # [N, 1]
        kth = torch.where(k_on[:, None], kth, float("-inf"))
        scores = scores.masked_fill(scores < kth, float("-inf"))

    nucleus = (top_p < 1.0).to(scores.device)  # [N]
    if bool(nucleus.any()):
        # Rows already cut to at most k_max tokens only need their top k_max sorted (ties at the k-th logit can
        # keep more than k, hence the count check).
        short = k_max < V and bool(((scores > float("-inf")).sum(dim=-1) <= k_max).all())
        if short:
            top_vals, top_idx = scores.topk(k_max, dim=-1)  # [N, k_max] descending
            sorted_asc, order = top_vals.flip(-1), top_idx.flip(-1)
        else:
            sorted_asc, order = scores.sort(dim=-1)  # [N, V]
        cum = sorted_asc.softmax(dim=-1).cumsum(dim=-1)  # [N, k_max or V]
        drop_sorted = cum <= (1.0 - top_p.float().to(scores.device))[:, None]
        drop_sorted[:, -1] = False  # the most likely token always stays
        drop_sorted &= nucleus[:, None]
        drop = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter(1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))

    probs = scores.softmax(dim=-1)  # [N, V]
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy.to(probs.device)[:, None], one_hot, probs)
    return probs


def sample(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of probs [N, V] (rows need not be normalized), row n drawn with generators[n] -> [N].

    Uses `torch.multinomial`, the call HF `generate` samples with, so a request seeded like HF's global generator
    draws the same token from the same probabilities. Each generator must live on probs' device.
    """
    assert probs.dim() == 2 and len(generators) == probs.shape[0], \
        f"probs must be [N, V] with N={len(generators)} generators, got shape {tuple(probs.shape)}"
    out = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    for n, g in enumerate(generators):
        out[n] = torch.multinomial(probs[n], 1, generator=g)[0]
    return out
