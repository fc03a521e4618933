"""Acceptance rules: greedy golden cases and greedy == AR through the packed tree; `exact` is distribution-exact
(chi-square against the AR joint, and a deliberately biased rule fails the same test); `apple` reduces to greedy
on one-hot targets and is shown not to be distribution-exact."""

import itertools

import pytest
import torch

from trt_redrafter.decoding.acceptance import (Acceptance, accept_apple, accept_exact, accept_greedy,
                                               emitted_tokens)
from trt_redrafter.decoding.sampling import draw, process_logits
from trt_redrafter.decoding.tree import pack_beams

chisquare = pytest.importorskip("scipy.stats").chisquare


def logits_with_argmax(target_tok: torch.Tensor, V: int, seed: int = 0) -> torch.Tensor:
    """[bs, nb, bl] argmax ids -> [bs, nb, bl, V] logits with exactly that argmax."""
    noise = torch.rand(*target_tok.shape, V, generator=torch.Generator().manual_seed(seed))
    return noise.scatter(-1, target_tok[..., None], 5.0)


def as_lists(acc: Acceptance):
    return acc.beam_index.tolist(), acc.num_accepted.tolist(), acc.next_token.tolist()


# ---- greedy ------------------------------------------------------------------------------------------------

def test_greedy_full_accept_takes_bonus():
    beams = torch.tensor([[[7, 1, 2, 3], [7, 1, 4, 4]]])
    target = torch.tensor([[[1, 2, 3, 9], [1, 2, 0, 0]]])  # beam 0 drafts the argmax chain; bonus = 9
    assert as_lists(accept_greedy(beams, logits_with_argmax(target, 10))) == ([0], [3], [9])


def test_greedy_reject_at_first_gives_correction():
    beams = torch.tensor([[[7, 1, 2], [7, 3, 2]]])
    target = torch.tensor([[[5, 0, 0], [5, 0, 0]]])
    assert as_lists(accept_greedy(beams, logits_with_argmax(target, 10))) == ([0], [0], [5])


def test_greedy_ties_pick_first_beam_and_longest_wins():
    beams = torch.tensor([[[7, 1, 2, 3], [7, 1, 2, 4], [7, 1, 6, 6]]])
    target = torch.tensor([[[1, 2, 5, 0], [1, 2, 5, 0], [1, 2, 0, 0]]])  # beams 0 and 1 both accept 2
    assert as_lists(accept_greedy(beams, logits_with_argmax(target, 10))) == ([0], [2], [5])
    beams = torch.tensor([[[7, 1, 6, 6], [7, 1, 2, 3], [7, 1, 2, 4]]])
    target = torch.tensor([[[1, 2, 0, 0], [1, 2, 3, 8], [1, 2, 3, 0]]])
    assert as_lists(accept_greedy(beams, logits_with_argmax(target, 10))) == ([1], [3], [8])


def test_greedy_batch_with_different_outcomes():
    beams = torch.tensor([[[7, 1, 2], [7, 3, 4]],
                          [[8, 1, 2], [8, 3, 4]],
                          [[9, 1, 2], [9, 1, 6]]])
    target = torch.tensor([[[3, 0, 0], [3, 4, 6]],   # beam 1 all accepted, bonus 6
                           [[0, 0, 0], [0, 0, 0]],   # nothing accepted, correction 0
                           [[1, 5, 0], [1, 5, 0]]])  # 1 accepted on both, tie -> beam 0, correction 5
    acc = accept_greedy(beams, logits_with_argmax(target, 10))
    assert as_lists(acc) == ([1, 0, 0], [2, 0, 1], [6, 0, 5])
    tokens, n = emitted_tokens(beams, acc)
    assert n.tolist() == [3, 1, 2]
    assert [row[:k] for row, k in zip(tokens.tolist(), n.tolist())] == [[3, 4, 6], [0], [1, 5]]


class MarkovTarget:
    """A stand-in target model: next-token logits depend on the last two tokens (random table, small V)."""

    def __init__(self, V: int, seed: int, scale: float = 2.0):
        self.V = V
        self.table = torch.randn(V, V, V, generator=torch.Generator().manual_seed(seed)) * scale

    def logits(self, seq: list[int]) -> torch.Tensor:
        return self.table[seq[-2], seq[-1]]


def verify_tree(model: MarkovTarget, context: list[int], beams: torch.Tensor) -> torch.Tensor:
    """What the engine's verify does, one request: score each packed node with its ancestors as context, then
    unpack to beam layout -> [1, nb, bl, V]. `context` excludes the true token beams[0, 0, 0]."""
    tree = pack_beams(beams)
    bl = beams.shape[2]
    n = int(tree.lengths[0])
    packed = torch.zeros(1, tree.tokens.shape[1], model.V)
    for p in range(n):
        i, j = divmod(int(tree.beam_positions[0, p]), bl)
        ancestors = tree.mask[0, p, :n].nonzero().squeeze(1).tolist()  # the tree mask gives the path
        path = tree.tokens[0, ancestors].tolist()
        assert path == beams[0, i, :j + 1].tolist()
        packed[0, p] = model.logits(context + path)
    return tree.unpack(packed)


def test_greedy_redrafter_equals_ar_through_the_tree():
    V, steps = 6, 25
    model = MarkovTarget(V, seed=0)
    g = torch.Generator().manual_seed(1)
    prompt = [0, 1]
    ar = list(prompt)
    while len(ar) < len(prompt) + steps + 8:
        ar.append(int(model.logits(ar).argmax()))

    out = list(prompt)
    true_tok = int(model.logits(out).argmax())  # the prompt step's token
    nb, dl = 3, 3
    while len(out) < len(prompt) + steps:
        out.append(true_tok)
        beams = torch.full((1, nb, dl + 1), true_tok)
        for i in range(nb):  # drafts: the right continuation with some errors, so acceptance varies
            seq = list(out)
            for j in range(1, dl + 1):
                right = int(model.logits(seq).argmax())
                tok = right if float(torch.rand(1, generator=g)) < 0.7 else int(torch.randint(V, (1,), generator=g))
                beams[0, i, j] = tok
                seq.append(tok)
        acc = accept_greedy(beams, verify_tree(model, out[:-1], beams))
        tokens, n = emitted_tokens(beams, acc)
        out += tokens[0, :int(n[0]) - 1].tolist()
        true_tok = int(acc.next_token[0])
    assert out == ar[:len(out)]


# ---- exact: distribution test ------------------------------------------------------------------------------

# First-order Markov target over V=3 tokens, and fixed beams rooted at the true token 0 (nb=3, dl=2):
# root 0 -> drafted children {1, 2}; node 0,1 -> {2, 0}; node 0,2 -> {2}.
T = torch.tensor([[0.35, 0.40, 0.25],
                  [0.20, 0.30, 0.50],
                  [0.45, 0.15, 0.40]])
BEAMS = torch.tensor([[0, 1, 2], [0, 1, 0], [0, 2, 2]])
N_SAMPLES = 20000


def markov_target_probs(beams: torch.Tensor) -> torch.Tensor:
    return T[beams]  # [bs, nb, bl, V]: position j holds P(. | beams[..., j])


def complete_with_ar(emitted: list[list[int]], length: int, seed: int) -> torch.Tensor:
    """Extend every emitted prefix to `length` tokens by sampling the Markov target (AR)."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((len(emitted), length), -1)
    for r, e in enumerate(emitted):
        out[r, :len(e)] = torch.tensor(e[:length])
    for k in range(1, length):
        need = out[:, k] < 0
        if need.any():
            out[need, k] = torch.multinomial(T[out[need, k - 1]], 1, generator=g).squeeze(1)
    return out


def chi_square_vs_ar(first3: torch.Tensor) -> float:
    cells = list(itertools.product(range(3), repeat=3))
    index = first3[:, 0] * 9 + first3[:, 1] * 3 + first3[:, 2]
    observed = torch.bincount(index, minlength=27).double()
    expected = torch.tensor([float(T[0, a] * T[a, b] * T[b, c]) for a, b, c in cells], dtype=torch.float64)
    return chisquare(observed.numpy(), (expected * len(first3)).numpy()).pvalue


def seeds(n: int, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(seed [n], base_position [n]) for n independent requests."""
    return torch.arange(offset, offset + n), torch.full((n,), 5)


def run_exact(n: int) -> tuple[Acceptance, torch.Tensor]:
    beams = BEAMS.expand(n, 3, 3).contiguous()
    return accept_exact(beams, markov_target_probs(beams), *seeds(n, 10_000)), beams


def test_exact_matches_ar_distribution():
    acc, beams = run_exact(N_SAMPLES)
    tokens, lengths = emitted_tokens(beams, acc)
    emitted = [row[:k] for row, k in zip(tokens.tolist(), lengths.tolist())]
    pvalue = chi_square_vs_ar(complete_with_ar(emitted, 3, seed=1))
    assert pvalue > 1e-3, f"exact acceptance deviates from AR sampling: chi-square p={pvalue:.3g}"
    # the chance of accepting at least one draft is the target mass on the drafted children {1, 2}
    frac = float((acc.num_accepted >= 1).double().mean())
    assert abs(frac - float(T[0, 1] + T[0, 2])) < 4 * (0.25 / N_SAMPLES) ** 0.5
    # all accepted -> bonus: 3 emitted tokens along a real beam
    full = acc.num_accepted == 2
    assert full.any() and all(tuple(r[:2]) in {(1, 2), (1, 0), (2, 2)} for r in tokens[full].tolist())


def biased_accept(beams: torch.Tensor, probs: torch.Tensor, gens) -> list[list[int]]:
    """A plausible-looking but lossy rule: take beam 0's first draft whenever it is in the target's top 2."""
    out = []
    for b in range(beams.shape[0]):
        root = probs[b, 0, 0]
        draft = int(beams[b, 0, 1])
        if draft in root.topk(2).indices.tolist():
            out.append([draft])
        else:
            out.append([int(torch.multinomial(root, 1, generator=gens[b]))])
    return out


def test_biased_rule_fails_the_same_test():
    n = N_SAMPLES
    beams = BEAMS.expand(n, 3, 3)
    gens = [torch.Generator().manual_seed(s) for s in range(n)]
    emitted = biased_accept(beams, markov_target_probs(beams), gens)
    pvalue = chi_square_vs_ar(complete_with_ar(emitted, 3, seed=2))
    assert pvalue < 1e-6, f"the chi-square test failed to detect a biased rule: p={pvalue:.3g}"


def test_exact_is_deterministic_per_seed_and_emits_ar_draws():
    beams = BEAMS.expand(64, 3, 3)
    probs = markov_target_probs(beams)
    a = accept_exact(beams, probs, *seeds(64))
    assert as_lists(a) == as_lists(accept_exact(beams, probs, *seeds(64)))
    # the first emitted token is AR's draw at the same (seed, position): from P(. | root) with that noise
    seed, base = seeds(64)
    ar_first = draw(T[beams[:, 0, 0]], seed, base + 1)
    tokens, _ = emitted_tokens(beams, a)
    assert tokens[:, 0].tolist() == ar_first.tolist()


def test_exact_with_one_hot_targets_equals_greedy():
    g = torch.Generator().manual_seed(3)
    bs, nb, bl, V = 6, 4, 4, 5
    beams = torch.randint(0, V, (bs, nb, bl), generator=g)
    beams[:, :, 0] = 0
    beams[:, :2, 1] = 1  # shared prefixes so some rows descend
    logits = torch.randn(bs, nb, bl, V, generator=g)
    # make the tree consistent: equal prefixes share target rows
    tree = pack_beams(beams)
    logits = tree.unpack(torch.randn(bs, tree.tokens.shape[1], V, generator=g))
    logits[:, :, 0, 1] = 10.0  # the root argmax is the shared draft 1
    probs = process_logits(logits.reshape(-1, V), torch.zeros(bs * nb * bl), torch.zeros(bs * nb * bl, dtype=torch.long),
                           torch.ones(bs * nb * bl)).reshape(bs, nb, bl, V)
    exact = accept_exact(beams, probs, *seeds(bs))
    greedy = accept_greedy(beams, logits)
    assert exact.num_accepted.tolist() == greedy.num_accepted.tolist()
    assert exact.next_token.tolist() == greedy.next_token.tolist()
    assert (exact.num_accepted >= 1).all()


# ---- apple -------------------------------------------------------------------------------------------------

def test_apple_with_one_hot_targets_equals_greedy():
    g = torch.Generator().manual_seed(4)
    bs, nb, bl, V = 8, 3, 4, 6
    target_tok = torch.randint(0, V, (bs, nb, bl), generator=g)
    # drafts follow the target argmax with probability 0.6 so acceptance lengths vary
    follow = torch.rand(bs, nb, bl - 1, generator=g) < 0.6
    drafts = torch.where(follow, target_tok[:, :, :-1], torch.randint(0, V, (bs, nb, bl - 1), generator=g))
    beams = torch.cat([torch.zeros(bs, nb, 1, dtype=torch.long), drafts], dim=2)
    logits = logits_with_argmax(target_tok, V, seed=5)
    one_hot = process_logits(logits.reshape(-1, V), torch.zeros(bs * nb * bl), torch.zeros(bs * nb * bl, dtype=torch.long),
                             torch.ones(bs * nb * bl)).reshape(bs, nb, bl, V)
    draft_logp = torch.log_softmax(torch.randn(bs, nb, bl - 1, V, generator=g), -1)
    apple = accept_apple(beams, one_hot.log(), draft_logp, *seeds(bs))
    greedy = accept_greedy(beams, logits)
    assert as_lists(apple) == as_lists(greedy)
    assert len(set(greedy.num_accepted.tolist())) > 1


def test_apple_runs_on_soft_targets():
    g = torch.Generator().manual_seed(6)
    bs, nb, bl, V = 4, 5, 3, 20
    beams = torch.randint(0, V, (bs, nb, bl), generator=g)
    target_logp = torch.log_softmax(torch.randn(bs, nb, bl, V, generator=g), -1)
    draft_logp = torch.log_softmax(torch.randn(bs, nb, bl - 1, V, generator=g), -1)
    a = accept_apple(beams, target_logp, draft_logp, *seeds(bs))
    assert as_lists(a) == as_lists(accept_apple(beams, target_logp, draft_logp, *seeds(bs)))
    assert ((a.num_accepted >= 0) & (a.num_accepted <= bl - 1)).all()
    assert ((a.next_token >= 0) & (a.next_token < V)).all()


def test_apple_is_not_distribution_exact_but_exact_is():
    # One deterministic draft (Q's argmax 0): Apple emits it with prob min(1, P/Q) = 0.6, while P(0) = 0.3.
    n = 4000
    P = torch.tensor([0.3, 0.5, 0.2])
    Q = torch.tensor([0.5, 0.3, 0.2])
    beams = torch.tensor([[[2, 0]]]).expand(n, 1, 2)
    target = P.expand(n, 1, 2, 3)
    apple = accept_apple(beams, target.log(), Q.log().expand(n, 1, 1, 3), *seeds(n))
    first = torch.where(apple.num_accepted > 0, 0, apple.next_token)
    expected = (P.double() * n).numpy()
    assert chisquare(torch.bincount(first, minlength=3).double().numpy(), expected).pvalue < 1e-6
    exact = accept_exact(beams, target, *seeds(n))
    first = torch.where(exact.num_accepted > 0, 0, exact.next_token)
    assert chisquare(torch.bincount(first, minlength=3).double().numpy(), expected).pvalue > 1e-3
