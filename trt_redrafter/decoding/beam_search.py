"""The drafter's beam search: from the base model's hidden state and the true token to nb candidate drafts.

This follows Apple's `Drafter.beam_search_candidates` (ml-recurrent-drafter, "v1.1" semantics, which TensorRT-LLM's
`_beam_search_candidates` also matches): deterministic beam search over the drafter's per-step log-probabilities.

Glossary:
    true token   the token the base model produced (sampled or argmax) at the last accepted position; column 0 of
                 every beam. It is not a draft: it is already part of the output.
    beam         [bl] = true token + dl drafted tokens; its score is the sum of the drafter's log-probs of its
                 drafted tokens.
    log_probs    [bs, nb, dl, V] the drafter's normalized log-distribution at every drafted position of every
                 returned beam (Q in the `apple` acceptance rule).

The loop, per drafting step t = 0..dl-1:
    state  <- drafter.update_state(embed(last token of each beam), state, t)
    logits <- drafter.logits(h, state); subtract the row max; optionally keep only the top-k (Apple's `warp_logits`,
              k = 50: the others are set to LOG_ZERO, which keeps a finite value instead of -inf)
    score  <- beam score + log_softmax(logits), over nb * V candidates; keep the top nb; gather beams, states and
              log-prob rows of their parents.
At t = 0 every beam is the same sequence [true token], so only beam 0 starts with score 0 and the others with
LOG_ZERO; otherwise step 0 would pick the same token nb times.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import torch

LOG_ZERO = -50000.0  # Apple's LOG_0 and TensorRT-LLM's -5e4: "log 0" that stays finite in half precision
DEFAULT_WARP_TOP_K = 50  # Apple's `warp_logits` default; the drafter distribution has at most this many tokens


class DrafterProtocol(Protocol):
    """What beam search needs from a drafter module (implemented by the model code; n = rows, H = hidden size)."""

    def init_state(self, n: int) -> torch.Tensor:
        """The recurrent state before the true token is consumed: [n, H] (Apple: zeros)."""

    def update_state(self, emb: torch.Tensor, state: torch.Tensor, step: int) -> torch.Tensor:
        """Consume one token embedding: emb [n, H], state [n, H] -> [n, H]; step 0 consumes the true token."""

    def logits(self, h: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """Next-token logits over the full vocabulary, float32: h [n, H], state [n, H] -> [n, V]."""


@dataclass
class BeamSearchResult:
    beams: torch.Tensor  # [bs, nb, bl] long; beams[:, :, 0] = true token
    log_probs: torch.Tensor  # [bs, nb, dl, V] float32; drafter log-distribution at each drafted position


def warp_logits(logits: torch.Tensor, k: Optional[int]) -> torch.Tensor:
    """Set every logit below the k-th largest of its row to LOG_ZERO (ties with the k-th are kept); None: no-op."""
    if k is None or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # [..., 1]
    return logits.masked_fill(logits < kth, LOG_ZERO)


def drafter_log_probs(drafter: DrafterProtocol, h: torch.Tensor, state: torch.Tensor,
                      warp_k: Optional[int]) -> torch.Tensor:
    """The drafter's normalized next-token log-distribution [n, V] float32 (Apple's `compute_logits` + log_softmax)."""
    logits = drafter.logits(h, state).float()  # [n, V]
    logits = logits - logits.max(dim=-1, keepdim=True).values  # Apple's `maintain_logits`
    return torch.log_softmax(warp_logits(logits, warp_k), dim=-1)


def beam_search(drafter: DrafterProtocol, embed: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor,
                true_token: torch.Tensor, num_beams: int, draft_len: int,
                warp_top_k: Optional[int] = DEFAULT_WARP_TOP_K) -> BeamSearchResult:
    """Draft `num_beams` beams of `draft_len` tokens for each row of h [bs, H] and true_token [bs].

    `embed` maps token ids [n] to embeddings [n, H] (the base model's input embedding, shared with the drafter).
    `warp_top_k` = 50 is Apple's drafter (what it was trained with); None is TensorRT-LLM's engine (no warp).
    """
    assert h.dim() == 2 and true_token.shape == (h.shape[0],), \
        f"h must be [bs, H] and true_token [bs], got {tuple(h.shape)} and {tuple(true_token.shape)}"
    assert true_token.dtype == torch.long, f"true_token must be int64, got {true_token.dtype}"
    assert num_beams >= 1 and draft_len >= 1, f"need num_beams >= 1 and draft_len >= 1, got {num_beams}, {draft_len}"
    bs, H = h.shape
    nb, dl = num_beams, draft_len
    device = h.device
    rows = torch.arange(bs, device=device)[:, None]  # [bs, 1] for gathering parents

    context = h[:, None, :].expand(bs, nb, H).reshape(bs * nb, H)  # [bs*nb, H], constant
    state = drafter.init_state(bs * nb)  # [bs*nb, H]
    beams = torch.empty(bs, nb, dl + 1, dtype=torch.long, device=device)  # [bs, nb, bl]
    beams[:, :, 0] = true_token[:, None]
    score = torch.full((bs, nb), LOG_ZERO, dtype=torch.float32, device=device)  # [bs, nb] log P(beam)
    score[:, 0] = 0.0
    log_probs: Optional[torch.Tensor] = None  # [bs, nb, dl, V], allocated once V is known

    for t in range(dl):
        state = drafter.update_state(embed(beams[:, :, t].reshape(-1)), state, t)  # [bs*nb, H]
        step_logp = drafter_log_probs(drafter, context, state, warp_top_k)  # [bs*nb, V]
        V = step_logp.shape[-1]
        step_logp = step_logp.view(bs, nb, V)
        if log_probs is None:
            log_probs = torch.empty(bs, nb, dl, V, dtype=torch.float32, device=device)
        candidates = (score[:, :, None] + step_logp).view(bs, nb * V)  # [bs, nb*V]
        score, flat = torch.topk(candidates, nb, dim=-1)  # [bs, nb]
        parent, token = flat // V, flat % V  # [bs, nb]

        beams[:, :, :t + 1] = beams[rows, parent, :t + 1]
        beams[:, :, t + 1] = token
        state = state.reshape(bs, nb, -1)[rows, parent].reshape(bs * nb, -1)
        log_probs[:, :, :t] = log_probs[rows, parent, :t]
        log_probs[:, :, t] = step_logp[rows, parent]

    assert log_probs is not None
    return BeamSearchResult(beams=beams, log_probs=log_probs)
