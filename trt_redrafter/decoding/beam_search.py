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
    scores       [bs, nb, dl] the score of each beam's first j + 1 drafted tokens: the drafter's confidence in
                 every node of the tree the beams make, which the speculation policy prunes trees by
                 (runtime/policy.py).

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
from typing import Callable, Optional, Protocol, Sequence

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
    log_probs: Optional[torch.Tensor]  # [bs, nb, dl, V] float32; drafter log-distribution at each drafted position
    scores: Optional[torch.Tensor] = None  # [bs, nb, dl] float32; log P(beam prefix up to each drafted position)


TopkFn = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]  # (x, k) -> values, indices (last dim)


def warp_logits(logits: torch.Tensor, k: Optional[int]) -> torch.Tensor:
    """Set every logit below the k-th largest of its row to LOG_ZERO (ties with the k-th are kept); None: no-op."""
    if k is None or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # [..., 1]
    return logits.masked_fill(logits < kth, LOG_ZERO)


def select_beams(step_logits: torch.Tensor, score: torch.Tensor, num_beams: int, warp_top_k: Optional[int],
                 need_log_probs: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """One beam-search selection, the literal way (the oracle): drafter logits [bs, nin, V] of the nin live beams
    and their scores [bs, nin] -> (scores [bs, nb], parent beam [bs, nb], token [bs, nb], step log-probs
    [bs, nin, V]).

    Max-subtract, optional top-k warp, log_softmax, add the parent's score, top nb over the nin*V candidates.
    """
    bs, nin, V = step_logits.shape
    logits = step_logits.float()
    logits = logits - logits.max(dim=-1, keepdim=True).values  # Apple's `maintain_logits`
    step_logp = torch.log_softmax(warp_logits(logits, warp_top_k), dim=-1)  # [bs, nin, V]
    candidates = (score[:, :, None] + step_logp).view(bs, nin * V)  # [bs, nin*V]
    new_score, flat = torch.topk(candidates, num_beams, dim=-1)  # [bs, nb]
    return new_score, flat // V, flat % V, step_logp


def select_beams_topk(step_logits: torch.Tensor, score: torch.Tensor, num_beams: int, warp_top_k: Optional[int],
                      need_log_probs: bool = False, topk: TopkFn = torch.topk, max_beams: Optional[int] = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """`select_beams` without touching nin*V candidates: the nb best of all beams' candidates are among each beam's
    own nb best (a beam's score is the same for all its tokens), and with the warp the top-k values also give the
    normalizer. So: one top-K per beam (K = max(nb, warp)), the log-normalizer from those K values (warp) or from
    a logsumexp over V (no warp), then top nb of the nin*nb survivors. Same selection as the oracle up to
    rounding (the normalizer is summed in another order) and exact ties; the kernel `plugins.beam_step` computes
    this too. The full log-probs are computed only when asked (`apple` acceptance). `topk(x, k)` -> (values,
    indices) along the last dimension, descending: `torch.topk`, or the CPU kernel `cpu.topk` (equal values in index
    order). `max_beams`: where num_beams is a symbolic size (a compiled step that drafts any count), its static bound:
    every choice of path is made by the bound, and each beam's max_beams best candidates are kept, among which its
    num_beams best are, in the same order (the same selection, ties included).
    """
    bs, nin, V = step_logits.shape
    nb = num_beams
    bound = nb if max_beams is None else max_beams
    if warp_top_k is not None and warp_top_k < bound:  # warped-out ties would be chosen: keep the literal algorithm
        return select_beams(step_logits, score, nb, warp_top_k, need_log_probs)
    if max_beams is None and nb == 1 and nin == 1 and not need_log_probs:
        # one beam is greedy drafting: the argmax, and its log-probability for the node's confidence (the normalizer
        # over the warp's top-k, or over V)
        logits = step_logits.float()
        top, token = logits.max(dim=-1)  # [bs, 1]; the first maximal index, as argmax
        kept = topk(logits, warp_top_k)[0] if warp_top_k is not None and warp_top_k < V else logits
        lse = torch.logsumexp(kept - top[..., None], dim=-1)  # [bs, 1]
        return score - lse, torch.zeros_like(score, dtype=torch.long), token, None
    logits = step_logits.float()
    K = min(max(bound, warp_top_k or 0), V)
    kk = min(bound, K)  # candidates kept per beam
    top, idx = topk(logits, K)  # [bs, nin, K] descending
    x = top - top[..., :1]  # max-subtracted, as the oracle
    if warp_top_k is not None and warp_top_k < V:
        lse = torch.logsumexp(x, dim=-1, keepdim=True)  # warped-out tokens sit at LOG_ZERO: exp() is 0
    else:
        lse = torch.logsumexp(logits - top[..., :1], dim=-1, keepdim=True)
    candidates = (score[:, :, None] + (x[..., :kk] - lse)).reshape(bs, nin * kk)  # [bs, nin*kk]
    new_score, flat = topk(candidates, nb)  # [bs, nb]
    token = idx[..., :kk].reshape(bs, nin * kk).gather(1, flat)
    step_logp = None
    if need_log_probs:
        step_logp = torch.log_softmax(warp_logits(logits - top[..., :1], warp_top_k), dim=-1)
    return new_score, flat // kk, token, step_logp


def runs(rows: torch.Tensor) -> torch.Tensor:
    """[] bool: whether a drafting step given these `depth_rows` rows runs (any rows at all). A value computed on the
    device, not the size read on the host: under inductor the size is unbacked, and branching on it would guard."""
    return torch.ones_like(rows, dtype=torch.bool).any()


SelectFn = Callable[[torch.Tensor, torch.Tensor, int, Optional[int], bool],
                    tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]


def beam_search(drafter: DrafterProtocol, embed: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor,
                true_token: torch.Tensor, num_beams: int, draft_len: int,
                warp_top_k: Optional[int] = DEFAULT_WARP_TOP_K, keep_log_probs: bool = True,
                select: SelectFn = select_beams, max_beams: Optional[int] = None,
                depth_rows: Optional[Sequence[torch.Tensor]] = None) -> BeamSearchResult:
    """Draft `num_beams` beams of `draft_len` tokens for each row of h [bs, H] and true_token [bs].

    `embed` maps token ids [n] to embeddings [n, H] (the base model's input embedding, shared with the drafter).
    `warp_top_k` = 50 is Apple's drafter (what it was trained with); None is TensorRT-LLM's engine (no warp).
    `keep_log_probs` (only `apple` acceptance reads them) gathers the chosen beams' per-step distributions;
    without it `log_probs` is None. `select` is `select_beams`, `select_beams_topk` or a kernel with their
    contract. No host sync: the loop runs inside a compiled step. `max_beams`: where num_beams is a symbolic size
    (an unbacked one: a compiled step that drafts any count up to it), its static bound, by which every choice of
    path is made (`select` must take it too: `select_beams_topk`), so that tracing never guards on the count.

    Step 0 runs the drafter on one row per request: every beam is still [true token] with the same state, so
    the nb rows of the literal algorithm are copies of one (only beam 0 is live: the others start at LOG_ZERO).

    `depth_rows` (dl - 1 index tensors, one per drafting step t = 1..dl-1): the rows of the [bs * nb] beams that step
    t runs the drafter on, all of them (arange(bs * nb)) or none (an empty tensor: the search stops before t, and
    so before every later step). A step without rows reads no drafter weight (its layers run over zero rows); its
    beams keep their parents, repeat their last token and score LOG_ZERO there, so the beams of a search of depth d
    are the d-step search's, padded to dl. An index tensor's length, not an int: in a compiled step it is an unbacked
    size, so one graph drafts any depth.
    """
    assert h.dim() == 2 and true_token.shape == (h.shape[0],), \
        f"h must be [bs, H] and true_token [bs], got {tuple(h.shape)} and {tuple(true_token.shape)}"
    assert true_token.dtype == torch.long, f"true_token must be int64, got {true_token.dtype}"
    assert draft_len >= 1, f"need draft_len >= 1, got {draft_len}"
    if max_beams is None:
        assert num_beams >= 1, f"need num_beams >= 1, got {num_beams}"
    else:
        torch._check(num_beams >= 1)
        torch._check(num_beams <= max_beams)
    bound = num_beams if max_beams is None else max_beams
    by_bound = {} if max_beams is None else {"max_beams": max_beams}
    bs, H = h.shape
    nb, dl = num_beams, draft_len
    device = h.device
    rows = torch.arange(bs, device=device)[:, None]  # [bs, 1] for gathering parents

    context = h[:, None, :].expand(bs, nb, H).reshape(bs * nb, H)  # [bs*nb, H], constant
    state = drafter.init_state(bs)  # [bs, H]: step 0 has one distinct row per request
    beams = true_token[:, None, None].expand(bs, nb, 1)  # [bs, nb, t+1], grown one column per step
    score = torch.full((bs, nb), LOG_ZERO, dtype=torch.float32, device=device)  # [bs, nb] log P(beam)
    score[:, 0] = 0.0
    log_probs: Optional[torch.Tensor] = None  # [bs, nb, t, V]
    history: Optional[torch.Tensor] = None  # [bs, nb, t] scores of each beam's prefixes

    # A draft vocabulary (K token ids, FR-Spec): select among its K columns and map the winners to token ids, which
    # is the selection over all V with LOG_ZERO outside it (exp(LOG_ZERO) is 0 in every normalizer), without
    # touching V columns; the `apple` rule reads the distributions over V, so it takes the long way.
    ids = getattr(drafter, "draft_vocab", None)
    if keep_log_probs or (ids is not None and warp_top_k is not None and ids.shape[0] <= warp_top_k):
        ids = None
    logits = drafter.logits if ids is None else drafter.head_logits
    if depth_rows is not None:
        assert len(depth_rows) == dl - 1, f"need {dl - 1} depth_rows tensors, got {len(depth_rows)}"
        assert not keep_log_probs, "a search of chosen depth keeps no log-probabilities (`apple` verifies whole trees)"
    for t in range(dl):
        live: Optional[torch.Tensor] = None  # [] bool: step t runs (depth_rows); None: it always does
        if t == 0:  # all beams are [true token] with the same state: run the drafter once and share the row
            state = drafter.update_state(embed(true_token), state, 0)  # [bs, H]
            step_logits = logits(h, state)[:, None]  # [bs, 1, V]
            # select among beam 0's candidates alone where that is the same selection: where its nb best all have
            # a finite log-probability (V >= nb, and no warp or one keeping >= nb tokens), each beats every candidate
            # of the LOG_ZERO beams, and the nb - 1 copies of its row would only cost a top-K each
            if step_logits.shape[-1] < bound or (warp_top_k is not None and warp_top_k < bound):
                step_logits = step_logits.expand(bs, nb, -1)  # [bs, nb, V]
            state = state[:, None].expand(bs, nb, H).reshape(bs * nb, H)
        elif depth_rows is not None:  # the rows of step t: all, or none where the search stops before it
            idx = depth_rows[t - 1]
            live = runs(idx)
            new = drafter.update_state(embed(beams[:, :, t].reshape(-1).index_select(0, idx)),
                                       state.index_select(0, idx), t)  # [rows, H]
            head = logits(context.index_select(0, idx), new)  # [rows, V]
            state = state.index_copy(0, idx, new)
            step_logits = head.new_zeros(bs * nb, head.shape[1]).index_copy(0, idx, head).reshape(bs, nb, -1)
        else:
            state = drafter.update_state(embed(beams[:, :, t].reshape(-1)), state, t)  # [bs*nb, H]
            step_logits = logits(context, state).reshape(bs, nb, -1)  # [bs, nb, V] float32
        parents = score[:, :step_logits.shape[1]]  # step 0 (one row): beam 0's score
        new_score, parent, token, step_logp = select(step_logits, parents, nb, warp_top_k, keep_log_probs,
                                                     **by_bound)
        if ids is not None:
            token = ids[token]
        if live is not None:  # a step past the search's depth: every beam keeps itself, repeats its last token
            parent = torch.where(live, parent, torch.arange(nb, device=device)[None, :])
            token = torch.where(live, token, beams[:, :, t])
            new_score = torch.where(live, new_score, torch.full_like(new_score, LOG_ZERO))
        score = new_score
        beams = torch.cat([beams[rows, parent], token[:, :, None]], dim=2)  # [bs, nb, t+2]
        history = score[:, :, None] if history is None else torch.cat([history[rows, parent], score[:, :, None]], 2)
        state = state.view(bs, nb, -1)[rows, parent].view(bs * nb, -1)
        if keep_log_probs:
            assert step_logp is not None, "this selector does not return log-probs"
            chosen = step_logp[rows, parent][:, :, None]  # [bs, nb, 1, V]
            log_probs = chosen if log_probs is None else torch.cat([log_probs[rows, parent], chosen], dim=2)
    return BeamSearchResult(beams=beams, log_probs=log_probs, scores=history)
