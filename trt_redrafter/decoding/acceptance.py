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
                   emitted tokens are distributed exactly as AR sampling's (they are AR's, for the same seed).
Both reduce to `accept_tokens` once the target's token after every tree node is known (argmax or one draw per
node), which is what the engine calls: one code path, and one kernel (`plugins.accept`), for both.
    accept_apple   Apple's / TensorRT-LLM's rule (`u < P/Q` per draft, best beam, residual relu(P - Q)); kept for
                   parity with them, not distribution-exact (see docs/decoding.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import sampling, tree


@dataclass
class Acceptance:
    beam_index: torch.Tensor  # [bs] long: the chosen beam
    num_accepted: torch.Tensor  # [bs] long: drafted tokens accepted, 0..dl
    next_token: torch.Tensor  # [bs] long: correction or bonus token (the next step's true token)

    def pack(self) -> torch.Tensor:
        """-> [3, bs] long, one tensor for a collective (TP ranks take rank 0's decision)."""
        return torch.stack([self.beam_index, self.num_accepted, self.next_token])

    @classmethod
    def unpack(cls, packed: torch.Tensor) -> "Acceptance":
        return cls(packed[0], packed[1], packed[2])


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
    return tree.running_all(ok).sum(dim=-1)


def accept_greedy(beams: torch.Tensor, target_logits: torch.Tensor) -> Acceptance:
    """Keep the longest drafted prefix that equals the target's argmax chain (Apple `_greedy_choose_from_candidates`).

    beams [bs, nb, bl], target_logits [bs, nb, bl, V]. Ties between beams go to the lowest beam index.
    """
    _check(beams, target_logits, "target_logits")
    return accept_tokens(beams, target_logits.argmax(dim=-1))


def accept_tokens(beams: torch.Tensor, node_tokens: torch.Tensor) -> Acceptance:
    """The accept rule every lossless mode reduces to, given the target's token after each beam position.

    beams [bs, nb, bl]; node_tokens [bs, nb, bl]: the target's choice after beams[:, i, :j+1] (the argmax for
    greedy, one draw per tree node for `exact`; beam positions through the same node carry the same token).
    Beam i keeps its leading drafts that equal the target's choice; the beam keeping most wins (first on ties),
    and the target's choice after its last kept draft is the next token.
    """
    assert beams.dim() == 3 and beams.dtype == torch.long and node_tokens.shape == beams.shape, \
        f"beams and node_tokens must be int64 [bs, nb, bl], got {tuple(beams.shape)} and {tuple(node_tokens.shape)}"
    bs = beams.shape[0]
    rows = torch.arange(bs, device=beams.device)
    n = _leading_true(beams[:, :, 1:] == node_tokens[:, :, :-1])  # [bs, nb]
    best = _first_max(n)  # [bs]
    num = n[rows, best]  # [bs]
    return Acceptance(beam_index=best, num_accepted=num, next_token=node_tokens[rows, best, num])


def accept_exact(beams: torch.Tensor, target_probs: torch.Tensor, seed: torch.Tensor,
                 base_position: torch.Tensor) -> Acceptance:
    """Walk the tree from the root, sampling the target at each node (lossless for any drafts).

    target_probs [bs, nb, bl, V] are already processed (`sampling.process_logits`); seed [bs]; base_position [bs]
    is the sequence position of the true token (column 0). The node at depth j draws t ~ target_probs[node] with the
    noise of position base + j + 1 (`sampling.draw`); the walk descends into the drafted child equal to t and stops
    at the first node whose draw is not drafted, emitting that draw (at depth dl, the bonus token).

    Drawing every node up front and then taking the longest matching path (`accept_tokens`) is the same walk: the
    drafted children of a node carry distinct tokens, so at most one child matches its draw, and a draw off the
    walk's path is never emitted. Every emitted token is a draw from the target at exactly its AR context with the
    noise AR would use there, so the output is distributed as AR sampling (it is AR's output, for the same seed);
    the chance of going one level deeper is the target mass on the drafted children, the most any lossless rule
    can get from fixed drafts.
    """
    _check(beams, target_probs, "target_probs")
    bs, nb, bl = beams.shape
    V = target_probs.shape[-1]
    pos = base_position[:, None, None] + 1 + torch.arange(bl, device=beams.device)  # [bs, 1, bl]
    drawn = sampling.draw(target_probs.reshape(bs * nb * bl, V), seed[:, None, None].expand(bs, nb, bl).reshape(-1),
                        pos.expand(bs, nb, bl).reshape(-1)).view(bs, nb, bl)
    return accept_tokens(beams, drawn)


def accept_apple(beams: torch.Tensor, target_logp: torch.Tensor, draft_logp: torch.Tensor, seed: torch.Tensor,
                 base_position: torch.Tensor) -> Acceptance:
    """Apple's / TensorRT-LLM's rejection rule (Apple `_choose_from_candidates`, TensorRT-LLM
    `_validate_draft_tokens` + `_prepare_drafter_input`). Not distribution-exact: the drafts are deterministic
    beam-search outputs rather than samples from Q, and the best of nb independently tested beams is kept.

    target_logp [bs, nb, bl, V] = log of the processed target probabilities; draft_logp [bs, nb, dl, V] = the
    beam search's `log_probs`; seed, base_position [bs] as in `accept_exact`. Each drafted token v is accepted iff
    u < exp(logP(v) - logQ(v)), u uniform and independent per (beam, position); a beam keeps its leading accepts;
    the beam with most wins (first on ties). The next token is drawn from P at the last position if everything was
    accepted, otherwise from normalize(relu(P - Q)) at the first rejected position (P itself if that residual is
    all zero).
    """
    _check(beams, target_logp, "target_logp")
    bs, nb, bl = beams.shape
    dl = bl - 1
    assert draft_logp.shape[:3] == (bs, nb, dl) and draft_logp.shape[3] == target_logp.shape[3], \
        f"draft_logp must be [bs, nb, dl, V]={(bs, nb, dl, target_logp.shape[3])}, got {tuple(draft_logp.shape)}"
    device = beams.device
    rows = torch.arange(bs, device=device)
    target_logp = target_logp.float()
    draft_logp = draft_logp.float()

    drafted = beams[:, :, 1:, None]  # [bs, nb, dl, 1]
    logp = target_logp[:, :, :dl].gather(-1, drafted).squeeze(-1)  # [bs, nb, dl]
    logq = draft_logp.gather(-1, drafted).squeeze(-1)  # [bs, nb, dl]
    u = sampling.uniform(sampling.row_keys(seed, base_position, sampling.STREAM_APPLE_U), nb * dl).view(bs, nb, dl)
    ok = u < torch.exp(logp - logq)  # NaN (both -inf) compares False: rejected
    n = _leading_true(ok)  # [bs, nb]
    best = _first_max(n)  # [bs]
    num = n[rows, best]  # [bs]

    p = target_logp[rows, best, num].exp()  # [bs, V] target at the first rejected (or the last) position
    q = draft_logp[rows, best, num.clamp(max=dl - 1)].exp()  # [bs, V]
    residual = torch.relu(p - q)
    use_p = (num == dl) | (residual.sum(dim=-1) <= 0)
    dist = torch.where(use_p[:, None], p, residual)
    return Acceptance(beam_index=best, num_accepted=num,
                      next_token=sampling.draw(dist, seed, base_position + 1 + num))


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
