"""Accept step: given the verified tree, choose a beam, how many of its drafts to keep, and the next true token.

Glossary (per request, per engine step):
    drafted token   beams[:, i, j] for j >= 1, proposed by the drafter's beam search.
    accepted token  a drafted token that becomes output; the accepted ones are always a prefix of one beam
                    (`beams[b, beam_index, 1 : 1 + num_accepted]`).
    next token      the one token the base model contributes this step, after the accepted ones: a correction when
                    a draft was rejected, the bonus token when all dl drafts were accepted. It is the true token
                    (column 0) of the next step's beams, so each step emits num_accepted + 1 tokens.
    bonus token     the next token when every drafted token of the chosen beam was accepted.

Inputs are in beam layout: the caller verifies the packed tree and unpacks per-token outputs with the tree's
`unpacker`, so position j of beam i holds the target distribution of the token that follows beams[:, i, j]
(all beams through one tree node carry the same row). Three rules:
    accept_greedy  exact argmax match (token-for-token the AR greedy output).
    accept_exact   sample the target at each tree node and descend into the drafted child that matches; the
                   emitted tokens are distributed exactly as AR sampling's.
    accept_apple   Apple's / TensorRT-LLM's rule (`u < P/Q` per draft, best beam, residual relu(P - Q)); kept for
                   parity with them, not distribution-exact (see docs/decoding.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import sample


@dataclass
class Acceptance:
    beam_index: torch.Tensor  # [bs] long: the chosen beam
    num_accepted: torch.Tensor  # [bs] long: drafted tokens accepted, 0..dl
    next_token: torch.Tensor  # [bs] long: correction or bonus token (the next step's true token)


def _check(beams: torch.Tensor, target: torch.Tensor, name: str) -> None:
    assert beams.dim() == 3 and beams.dtype == torch.long, \
        f"beams must be int64 [bs, nb, bl], got {beams.dtype} {tuple(beams.shape)}"
    assert target.dim() == 4 and target.shape[:3] == beams.shape, \
        f"{name} must be [bs, nb, bl, V] with [bs, nb, bl]={tuple(beams.shape)}, got {tuple(target.shape)}"


def _first_max(n: torch.Tensor) -> torch.Tensor:
    """Index of the first maximum along dim 1 of n [bs, nb] -> [bs] (explicit, not relying on argmax tie order)."""
    nb = n.shape[1]
    idx = torch.arange(nb, device=n.device).expand_as(n)
    return torch.where(n == n.max(dim=1, keepdim=True).values, idx, nb).amin(dim=1)


def _leading_true(ok: torch.Tensor) -> torch.Tensor:
    """Length of the all-True prefix along the last dim: [bs, nb, dl] bool -> [bs, nb] long."""
    return torch.cumprod(ok.to(torch.int32), dim=-1).sum(dim=-1).long()


def accept_greedy(beams: torch.Tensor, target_logits: torch.Tensor) -> Acceptance:
    """Keep the longest drafted prefix that equals the target's argmax chain (Apple `_greedy_choose_from_candidates`).

    beams [bs, nb, bl], target_logits [bs, nb, bl, V]. Ties between beams go to the lowest beam index.
    """
    _check(beams, target_logits, "target_logits")
    bs = beams.shape[0]
    rows = torch.arange(bs, device=beams.device)
    target_tok = target_logits.argmax(dim=-1)  # [bs, nb, bl]
    n = _leading_true(beams[:, :, 1:] == target_tok[:, :, :-1])  # [bs, nb]
    best = _first_max(n)  # [bs]
    num = n[rows, best]  # [bs]
    return Acceptance(beam_index=best, num_accepted=num, next_token=target_tok[rows, best, num])


def accept_exact(beams: torch.Tensor, target_probs: torch.Tensor,
                 generators: list[torch.Generator]) -> Acceptance:
    """Walk the tree from the root, sampling the target at each node (lossless for any drafts).

    target_probs [bs, nb, bl, V] are already processed (`sampling.process_logits`). At node depth j, draw
    t ~ target_probs[node]; if a beam still on the current path drafted t at depth j + 1, descend (keep only those
    beams); otherwise t is the next token. At depth dl the draw is the bonus token. Every emitted token is a draw
    from the target at exactly its AR context, so the output is distributed as AR sampling; the chance of going one
    level deeper is the target mass on the drafted children, the most any lossless rule can get from fixed drafts.
    Each request's generator is used only for its own draws (at most num_accepted + 1 of them).
    """
    _check(beams, target_probs, "target_probs")
    bs, nb, bl = beams.shape
    assert len(generators) == bs, f"need one generator per request: bs={bs}, got {len(generators)}"
    device = beams.device
    rows = torch.arange(bs, device=device)
    beam_ids = torch.arange(nb, device=device).expand(bs, nb)
    on_path = torch.ones(bs, nb, dtype=torch.bool, device=device)  # beams through the current node
    active = torch.ones(bs, dtype=torch.bool, device=device)  # rows still descending
    num = torch.zeros(bs, dtype=torch.long, device=device)
    next_token = torch.zeros(bs, dtype=torch.long, device=device)

    for j in range(bl):
        act = active.nonzero().squeeze(1)  # [bs_active]
        if act.numel() == 0:
            break
        node_beam = torch.where(on_path, beam_ids, nb).amin(dim=1)  # [bs] first beam through the node
        dist = target_probs[rows[act], node_beam[act], j]  # [bs_active, V]
        drawn = torch.full((bs,), -1, dtype=torch.long, device=device)
        drawn[act] = sample(dist, [generators[i] for i in act.tolist()])
        if j == bl - 1:  # every draft accepted: the draw at the last node is the bonus token
            num[act] = bl - 1
            next_token[act] = drawn[act]
            break
        child = on_path & (beams[:, :, j + 1] == drawn[:, None])  # [bs, nb]
        descend = active & child.any(dim=1)  # [bs]
        stop = active & ~descend
        num[stop] = j
        next_token[stop] = drawn[stop]
        on_path = torch.where(descend[:, None], child, on_path)
        active = descend

    beam_index = torch.where(on_path, beam_ids, nb).amin(dim=1)
    assert bool((beam_index < nb).all()), "every row keeps at least one beam on its path"
    return Acceptance(beam_index=beam_index, num_accepted=num, next_token=next_token)


def accept_apple(beams: torch.Tensor, target_logp: torch.Tensor, draft_logp: torch.Tensor,
                 generators: list[torch.Generator]) -> Acceptance:
    """Apple's / TensorRT-LLM's rejection rule (Apple `_choose_from_candidates`, TensorRT-LLM
    `_validate_draft_tokens` + `_prepare_drafter_input`). Not distribution-exact: the drafts are deterministic
    beam-search outputs rather than samples from Q, and the best of nb independently tested beams is kept.

    target_logp [bs, nb, bl, V] = log of the processed target probabilities; draft_logp [bs, nb, dl, V] = the
    beam search's `log_probs`. Each drafted token v is accepted iff u < exp(logP(v) - logQ(v)), u ~ U[0, 1)
    independent per (beam, position); a beam keeps its leading accepts; the beam with most wins (first on ties).
    The next token is drawn from P at the last position if everything was accepted, otherwise from
    normalize(relu(P - Q)) at the first rejected position (P itself if that residual is all zero).
    """
    _check(beams, target_logp, "target_logp")
    bs, nb, bl = beams.shape
    dl = bl - 1
    assert draft_logp.shape[:3] == (bs, nb, dl) and draft_logp.shape[3] == target_logp.shape[3], \
        f"draft_logp must be [bs, nb, dl, V]={(bs, nb, dl, target_logp.shape[3])}, got {tuple(draft_logp.shape)}"
    assert len(generators) == bs, f"need one generator per request: bs={bs}, got {len(generators)}"
    device = beams.device
    rows = torch.arange(bs, device=device)
    target_logp = target_logp.float()
    draft_logp = draft_logp.float()

    drafted = beams[:, :, 1:, None]  # [bs, nb, dl, 1]
    logp = target_logp[:, :, :dl].gather(-1, drafted).squeeze(-1)  # [bs, nb, dl]
    logq = draft_logp.gather(-1, drafted).squeeze(-1)  # [bs, nb, dl]
    u = torch.stack([torch.rand(nb, dl, generator=g, device=device) for g in generators])  # [bs, nb, dl]
    ok = u < torch.exp(logp - logq)  # NaN (both -inf) compares False: rejected
    n = _leading_true(ok)  # [bs, nb]
    best = _first_max(n)  # [bs]
    num = n[rows, best]  # [bs]

    p = target_logp[rows, best, num].exp()  # [bs, V] target at the first rejected (or the last) position
    q = draft_logp[rows, best, num.clamp(max=dl - 1)].exp()  # [bs, V]
    residual = torch.relu(p - q)
    use_p = (num == dl) | (residual.sum(dim=-1) <= 0)
    dist = torch.where(use_p[:, None], p, residual)
    return Acceptance(beam_index=best, num_accepted=num, next_token=sample(dist, generators))


def emitted_tokens(beams: torch.Tensor, acc: Acceptance) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens a step emits: accepted drafts then the next token -> (tokens [bs, bl], lengths [bs] = num_accepted+1).

    Positions >= lengths[b] repeat the next token (a valid id, never to be read).
    """
    bs, nb, bl = beams.shape
    rows = torch.arange(bs, device=beams.device)
    chosen = beams[rows, acc.beam_index, 1:]  # [bs, dl]
    pos = torch.arange(bl, device=beams.device)[None, :]  # [1, bl]
    drafts = torch.cat([chosen, chosen[:, :1]], dim=1)  # [bs, bl]; the last column is overwritten below
    tokens = torch.where(pos < acc.num_accepted[:, None], drafts, acc.next_token[:, None])
    return tokens, acc.num_accepted + 1
