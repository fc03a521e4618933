"""One drafter beam-search selection on CUDA: warp + log-softmax normalizer + beam score + top nb of all candidates.

Oracle: `decoding.beam_search.select_beams` (and its fast PyTorch form `select_beams_topk`, same contract).

The nb best of all nin*V candidates are among each beam's own nb best, and Apple's top-50 warp needs each row's
50 largest logits anyway; so each row's top K = max(nb, warp) comes from `torch.topk` (a radix select, the one
step of this search that reads all of V), and one program per request then does everything else in registers:
the row normalizer (logsumexp of the K warped values, or an online logsumexp over V without the warp, which is
TensorRT-LLM's drafter), candidate scores = beam score + log-prob, and the top nb of the nin*nb survivors by nb
rounds of argmax. The full log-probs are produced only when `apple` acceptance asks for them.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..decoding.beam_search import select_beams_topk, warp_logits


@triton.jit
def _beam_step_kernel(top_ptr, idx_ptr, logits_ptr, score_ptr, out_score_ptr, out_parent_ptr, out_token_ptr,
                      NIN, K, KK, V, stride_lb, stride_li,
                      NB: tl.constexpr, NIN_PAD: tl.constexpr, K_PAD: tl.constexpr, WARP: tl.constexpr,
                      BLOCK_V: tl.constexpr):
    b = tl.program_id(0)
    r = tl.arange(0, NIN_PAD)[:, None]  # live beam (row)
    c = tl.arange(0, K_PAD)[None, :]  # candidate rank within the row
    row_ok = r < NIN
    top = tl.load(top_ptr + (b * NIN + r) * K + c, mask=row_ok & (c < K), other=float("-inf"))  # [NIN_PAD, K_PAD]
    m = tl.max(top, axis=1)  # row max (= column 0: topk is sorted)
    m = tl.where(m == float("-inf"), 0.0, m)
    x = top - m[:, None]
    if WARP:  # warped-out tokens sit at LOG_ZERO: their exp is 0
        lse = tl.log(tl.where(tl.arange(0, NIN_PAD) < NIN, tl.sum(tl.exp(x), axis=1), 1.0))
    else:  # online logsumexp over the whole row
        acc = tl.zeros([NIN_PAD], tl.float32)
        for v0 in range(0, V, BLOCK_V):
            v = v0 + tl.arange(0, BLOCK_V)[None, :]
            l = tl.load(logits_ptr + b * stride_lb + r * stride_li + v, mask=row_ok & (v < V), other=float("-inf"))
            acc += tl.sum(tl.exp(l - m[:, None]), axis=1)
        lse = tl.log(tl.where(tl.arange(0, NIN_PAD) < NIN, acc, 1.0))
    score = tl.load(score_ptr + b * NIN + tl.arange(0, NIN_PAD), mask=tl.arange(0, NIN_PAD) < NIN, other=0.0)
    cand = score[:, None] + x - lse[:, None]
    cand = tl.where(row_ok & (c < KK), cand, float("-inf"))
    flat = tl.reshape(cand, [NIN_PAD * K_PAD])
    pos = tl.arange(0, NIN_PAD * K_PAD)
    for s in tl.static_range(NB):  # the nb best, best first (first position on ties)
        best = tl.max(flat, axis=0)
        at = tl.min(tl.where(flat == best, pos, NIN_PAD * K_PAD), axis=0)
        parent = at // K_PAD
        token = tl.load(idx_ptr + (b * NIN + parent) * K + at % K_PAD)
        tl.store(out_score_ptr + b * NB + s, best)
        tl.store(out_parent_ptr + b * NB + s, parent.to(tl.int64))
        tl.store(out_token_ptr + b * NB + s, token)
        flat = tl.where(pos == at, float("-inf"), flat)


def beam_step(step_logits: torch.Tensor, score: torch.Tensor, num_beams: int, warp_top_k: Optional[int],
              need_log_probs: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """step_logits [bs, nin, V] float32, score [bs, nin] -> (score [bs, nb], parent [bs, nb], token [bs, nb],
    log-probs [bs, nin, V] or None); see decoding.beam_search.select_beams."""
    assert step_logits.dim() == 3 and score.shape == step_logits.shape[:2], \
        f"step_logits must be [bs, nin, V] and score [bs, nin], got {tuple(step_logits.shape)}, {tuple(score.shape)}"
    bs, nin, V = step_logits.shape
    nb = num_beams
    if (warp_top_k is not None and warp_top_k < nb) or (nb == 1 and nin == 1 and not need_log_probs):
        # the cases select_beams_topk does not run its top-K merge for (warped-out ties; one-beam greedy drafting)
        return select_beams_topk(step_logits, score, nb, warp_top_k, need_log_probs)
    logits = step_logits.float()
    K = min(max(nb, warp_top_k or 0), V)
    top, idx = logits.topk(K, dim=-1)  # [bs, nin, K]
    top, idx = top.contiguous(), idx.contiguous()
    if logits.stride(2) != 1:
        logits = logits.contiguous()
    warp = warp_top_k is not None and warp_top_k < V
    out_score = torch.empty(bs, nb, dtype=torch.float32, device=logits.device)
    out_parent = torch.empty(bs, nb, dtype=torch.long, device=logits.device)
    out_token = torch.empty(bs, nb, dtype=torch.long, device=logits.device)
    _beam_step_kernel[(bs,)](top, idx, logits, score.float().contiguous(), out_score, out_parent, out_token,
                             nin, K, min(nb, K), V, logits.stride(0), logits.stride(1),
                             NB=nb, NIN_PAD=max(2, triton.next_power_of_2(nin)),
                             K_PAD=max(2, triton.next_power_of_2(K)), WARP=warp, BLOCK_V=1024)
    step_logp = None
    if need_log_probs:
        x = logits - logits.max(dim=-1, keepdim=True).values
        step_logp = torch.log_softmax(warp_logits(x, warp_top_k), dim=-1)
    return out_score, out_parent, out_token, step_logp
