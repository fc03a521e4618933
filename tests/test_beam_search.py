"""Drafter beam search against slow references: a list-based beam search, exhaustive enumeration, greedy drafting."""

import itertools

import pytest
import torch

from trt_redrafter.decoding.beam_search import (LOG_ZERO, BeamSearchResult, beam_search, select_beams,
                                                select_beams_topk)


class TinyDrafter:
    """An Apple-style RNN drafter with random weights: s' = SiLU(W e + U s + b), logits = [h, s] @ head."""

    def __init__(self, V: int, H: int = 8, seed: int = 0, scale: float = 2.0):
        g = torch.Generator().manual_seed(seed)
        self.V, self.H = V, H
        self.emb = torch.randn(V, H, generator=g)
        self.W = torch.randn(H, H, generator=g) / H ** 0.5
        self.U = torch.randn(H, H, generator=g) / H ** 0.5
        self.b = torch.randn(H, generator=g) * 0.1
        self.head = torch.randn(2 * H, V, generator=g) * scale / H ** 0.5

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb[ids]

    def init_state(self, n: int) -> torch.Tensor:
        return torch.zeros(n, self.H)

    def update_state(self, emb, state, step):
        return torch.nn.functional.silu(emb @ self.W + state @ self.U + self.b)

    def logits(self, h, state):
        return torch.cat([h, state], dim=-1) @ self.head


def ref_log_dist(d: TinyDrafter, h_row: torch.Tensor, prefix: list[int], warp_k):
    """Drafter log-distribution after `prefix` (true token first), recomputed from scratch, Apple's warp."""
    state = d.init_state(1)
    for t, tok in enumerate(prefix):
        state = d.update_state(d.embed(torch.tensor([tok])), state, t)
    logits = d.logits(h_row[None], state)[0]
    logits = logits - logits.max()
    if warp_k is not None and warp_k < d.V:
        kth = logits.sort(descending=True).values[warp_k - 1]
        logits = torch.where(logits < kth, torch.tensor(LOG_ZERO), logits)
    return torch.log_softmax(logits, -1)


def slow_beam_search(d, h_row, true_tok, nb, dl, warp_k):
    beams = [([true_tok], torch.tensor(0.0))] + [([true_tok], torch.tensor(LOG_ZERO))] * (nb - 1)
    for _ in range(dl):
        cands = []
        for seq, score in beams:
            lp = ref_log_dist(d, h_row, seq, warp_k)
            cands += [(score + lp[v], seq + [v]) for v in range(d.V)]
        cands.sort(key=lambda c: -float(c[0]))
        beams = [(seq, score) for score, seq in cands[:nb]]
    return beams


def run(d, h, true_tok, nb, dl, warp_k=50) -> BeamSearchResult:
    return beam_search(d, d.embed, h, true_tok, num_beams=nb, draft_len=dl, warp_top_k=warp_k)


def check_log_probs_consistent(d, h, res, warp_k):
    bs, nb, bl = res.beams.shape
    for b in range(bs):
        for i in range(nb):
            seq = res.beams[b, i].tolist()
            for j in range(bl - 1):
                torch.testing.assert_close(res.log_probs[b, i, j], ref_log_dist(d, h[b], seq[:j + 1], warp_k),
                                           rtol=1e-5, atol=1e-4)


def test_matches_slow_reference_with_warp():
    d = TinyDrafter(V=7, seed=1)
    h = torch.randn(2, d.H, generator=torch.Generator().manual_seed(2))
    true_tok = torch.tensor([3, 5])
    res = run(d, h, true_tok, nb=3, dl=4, warp_k=4)
    assert res.beams.shape == (2, 3, 5) and res.log_probs.shape == (2, 3, 4, 7)
    for b in range(2):
        ref = slow_beam_search(d, h[b], int(true_tok[b]), 3, 4, 4)
        assert res.beams[b].tolist() == [seq for seq, _ in ref]
        got_scores = res.log_probs[b].gather(-1, res.beams[b, :, 1:, None]).squeeze(-1).sum(-1)
        torch.testing.assert_close(got_scores, torch.stack([s for _, s in ref]), rtol=1e-5, atol=1e-4)
    check_log_probs_consistent(d, h, res, 4)
    # warped rows: exactly 4 tokens carry mass, the rest sit at ~LOG_ZERO
    assert ((res.log_probs > LOG_ZERO / 2).sum(-1) == 4).all()


@pytest.mark.parametrize("select", [select_beams, select_beams_topk])
@pytest.mark.parametrize("warp_k", [None, 3, 2])
def test_first_step_from_one_row_equals_the_literal_search(select, warp_k):
    # step 0 selects among beam 0's candidates only (where its nb best have finite log-probabilities: warp None or
    # >= nb); the literal search ranks the nb - 1 LOG_ZERO copies too. Same beams and scores either way, and with a
    # warp below nb (2 < 3: warped-out tokens compete with the copies) the search keeps the copies.
    d = TinyDrafter(V=9, seed=7)
    h = torch.randn(3, d.H, generator=torch.Generator().manual_seed(8))
    true_tok = torch.tensor([0, 4, 8])
    res = beam_search(d, d.embed, h, true_tok, num_beams=3, draft_len=3, warp_top_k=warp_k, keep_log_probs=False,
                      select=select)
    for b in range(3):
        ref = slow_beam_search(d, h[b], int(true_tok[b]), 3, 3, warp_k)
        assert res.beams[b].tolist() == [seq for seq, _ in ref]
        torch.testing.assert_close(res.scores[b, :, -1], torch.stack([s for _, s in ref]), rtol=1e-5, atol=1e-3)


def test_exhaustive_when_beams_cover_every_prefix():
    # V=3, dl=3, nb=9=V^2: all 9 two-token prefixes survive, so the result is the global top 9 of all 27 drafts.
    d = TinyDrafter(V=3, seed=3)
    h = torch.randn(1, d.H, generator=torch.Generator().manual_seed(4))
    res = run(d, h, torch.tensor([1]), nb=9, dl=3, warp_k=None)
    scored = []
    for drafts in itertools.product(range(3), repeat=3):
        seq = [1, *drafts]
        s = sum(float(ref_log_dist(d, h[0], seq[:j + 1], None)[seq[j + 1]]) for j in range(3))
        scored.append((s, seq))
    scored.sort(key=lambda c: -c[0])
    assert res.beams[0].tolist() == [seq for _, seq in scored[:9]]
    check_log_probs_consistent(d, h, res, None)
    assert (res.log_probs > LOG_ZERO / 2).all()  # no warp: full support (TensorRT-LLM's variant)


@pytest.mark.parametrize("nb", [1, 6])
@pytest.mark.parametrize("dl", [1, 4])
def test_shapes_and_invariants(nb, dl):
    V = 60
    d = TinyDrafter(V=V, seed=5)
    h = torch.randn(3, d.H, generator=torch.Generator().manual_seed(6))
    true_tok = torch.tensor([0, 17, 59])
    res = run(d, h, true_tok, nb=nb, dl=dl)
    assert res.beams.shape == (3, nb, dl + 1) and res.beams.dtype == torch.long
    assert res.log_probs.shape == (3, nb, dl, V) and res.log_probs.dtype == torch.float32
    assert (res.beams[:, :, 0] == true_tok[:, None]).all()
    torch.testing.assert_close(res.log_probs.logsumexp(-1), torch.zeros(3, nb, dl), atol=1e-5, rtol=0)
    assert ((res.log_probs > LOG_ZERO / 2).sum(-1) == 50).all()  # Apple's top-50 warp
    scores = res.log_probs.gather(-1, res.beams[:, :, 1:, None]).squeeze(-1).sum(-1)  # [bs, nb]
    assert (scores[:, 1:] <= scores[:, :-1]).all(), "beams come out best first"
    for b in range(3):
        assert len({tuple(x) for x in res.beams[b].tolist()}) == nb, "beams are distinct"
    # each row is independent of the others in the batch
    alone = run(d, h[1:2], true_tok[1:2], nb=nb, dl=dl)
    assert torch.equal(alone.beams[0], res.beams[1])
    torch.testing.assert_close(alone.log_probs[0], res.log_probs[1])
    check_log_probs_consistent(d, h, res, 50)


@pytest.mark.parametrize("warp_k", [50, None])
def test_single_beam_is_greedy_drafting(warp_k):
    d = TinyDrafter(V=80, seed=7)
    h = torch.randn(2, d.H, generator=torch.Generator().manual_seed(8))
    true_tok = torch.tensor([4, 9])
    res = run(d, h, true_tok, nb=1, dl=5, warp_k=warp_k)
    for b in range(2):
        seq = [int(true_tok[b])]
        state = d.init_state(1)
        for t in range(5):
            state = d.update_state(d.embed(torch.tensor([seq[-1]])), state, t)
            seq.append(int(d.logits(h[b:b + 1], state).argmax()))
        assert res.beams[b, 0].tolist() == seq


def test_deterministic():
    d = TinyDrafter(V=30, seed=9)
    h = torch.randn(2, d.H, generator=torch.Generator().manual_seed(10))
    a = run(d, h, torch.tensor([1, 2]), nb=4, dl=3)
    b = run(d, h, torch.tensor([1, 2]), nb=4, dl=3)
    assert torch.equal(a.beams, b.beams) and torch.equal(a.log_probs, b.log_probs)


@pytest.mark.parametrize("vocab", [500, 8192])
@pytest.mark.parametrize("kernel", ["torch", "cpu"])
@pytest.mark.parametrize("warp", [50, None])
def test_fast_selection_picks_the_oracles_beams(warp, kernel, vocab):
    """select_beams_topk (the engine's CPU path) chooses what the literal nb*V top-k chooses, one beam included, with
    torch.topk and with the CPU top-k kernel (cpu/topk.cpp: its scan below 1024 values a row, its bound above)."""
    from trt_redrafter import cpu
    from trt_redrafter.decoding.beam_search import select_beams, select_beams_topk

    if kernel == "cpu":
        if not cpu.available(torch.float32):
            pytest.skip("this CPU has no AVX-512")
        cpu.ops()  # on such a CPU the kernels must build: a failure here is a failure
    topk = cpu.topk if kernel == "cpu" else torch.topk
    g = torch.Generator().manual_seed(7)
    for nin, nb in ((6, 6), (4, 4), (1, 6), (1, 1), (3, 2)):
        logits = torch.randn(4, nin, vocab, generator=g) * 3
        score = torch.randn(4, nin, generator=g)
        ref = select_beams(logits, score, nb, warp)
        for need in (True, False):
            got = select_beams_topk(logits, score, nb, warp, need, topk=topk)
            assert torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2]), (nin, nb, need)
            if need:
                torch.testing.assert_close(got[0], ref[0])
                torch.testing.assert_close(got[3], ref[3])
