"""process_logits equals Hugging Face's warpers; the counter-based draw is deterministic per (seed, position),
independent of batch mates, and unbiased."""

import pytest
import torch

from trt_redrafter.decoding.sampling import STREAM_TOKEN, draw, process_logits, row_keys, uniform

warpers = pytest.importorskip("transformers.generation.logits_process")


def hf_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """One row through HF generate's warper chain (temperature -> top-k -> top-p), as `generate` builds it."""
    scores = logits[None].float()
    chain = [warpers.TemperatureLogitsWarper(temperature)]
    if top_k > 0:
        chain.append(warpers.TopKLogitsWarper(top_k))
    if top_p < 1.0:
        chain.append(warpers.TopPLogitsWarper(top_p))
    for w in chain:
        scores = w(None, scores)
    return scores.softmax(-1)[0]


def test_process_logits_matches_hf_warpers():
    g = torch.Generator().manual_seed(0)
    V = 40
    settings = [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.9), (0.5, 10, 0.8), (2.0, 1, 0.5),
                (1.0, 100, 0.3), (0.9, 3, 0.999), (1.0, 0, 0.01)]
    logits = torch.randn(len(settings), V, generator=g) * 3
    t = torch.tensor([s[0] for s in settings])
    k = torch.tensor([s[1] for s in settings])
    p = torch.tensor([s[2] for s in settings])
    probs = process_logits(logits, t, k, p)
    assert probs.dtype == torch.float32 and probs.shape == (len(settings), V)
    for n, (tn, kn, pn) in enumerate(settings):
        torch.testing.assert_close(probs[n], hf_probs(logits[n], tn, kn, pn), rtol=1e-5, atol=1e-7)
    assert torch.allclose(probs.sum(-1), torch.ones(len(settings)))
    # top_k=1 and tiny top_p both leave exactly one token
    assert int((probs[5] > 0).sum()) == 1 and int((probs[8] > 0).sum()) == 1


def test_temperature_zero_is_one_hot_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0, 2.0], [5.0, 1.0, 0.0, 0.0]])
    probs = process_logits(logits, torch.tensor([0.0, 1.0]), torch.tensor([0, 0]), torch.tensor([1.0, 0.5]))
    assert probs[0].tolist() == [0.0, 1.0, 0.0, 0.0]  # first argmax on ties, like torch.argmax
    assert probs[1, 0] > 0.9


def test_top_p_keeps_smallest_set_reaching_p():
    probs_in = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    out = process_logits(probs_in.log(), torch.ones(1), torch.zeros(1, dtype=torch.long), torch.tensor([0.75]))
    torch.testing.assert_close(out, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    out = process_logits(probs_in.log(), torch.ones(1), torch.zeros(1, dtype=torch.long), torch.tensor([0.85]))
    assert int((out > 0).sum()) == 3


def test_draw_depends_only_on_seed_position_and_probs():
    probs = torch.softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(1)), -1)
    seed, pos = torch.tensor([1, 2, 3]), torch.tensor([10, 10, 11])
    a = draw(probs, seed, pos)
    assert torch.equal(a, draw(probs, seed, pos))
    # row 1 alone draws what it drew inside the batch
    assert int(draw(probs[1:2], seed[1:2], pos[1:2])[0]) == int(a[1])
    # other positions and other seeds give other noise
    many = draw(probs[:1].expand(200, 50), torch.full((200,), 1), torch.arange(200))
    assert len(set(many.tolist())) > 10
    many = draw(probs[:1].expand(200, 50), torch.arange(200), torch.full((200,), 10))
    assert len(set(many.tolist())) > 10


def test_draw_frequencies_follow_probs():
    from scipy.stats import chisquare

    p = torch.tensor([0.5, 0.25, 0.125, 0.0, 0.125])
    N = 8000
    draws = draw(p.expand(N, 5), torch.arange(N) // 40, torch.arange(N) % 40)  # 200 seeds x 40 positions
    counts = torch.bincount(draws, minlength=5).double()
    assert counts[3] == 0  # zero probability is never drawn
    keep = p > 0
    assert chisquare(counts[keep].numpy(), (p[keep].double() * N).numpy()).pvalue > 1e-3


def test_uniform_noise_is_uniform_and_in_range():
    from scipy.stats import kstest

    u = uniform(row_keys(torch.arange(64), torch.arange(64) * 7, STREAM_TOKEN), 512).flatten()
    assert float(u.min()) > 0 and float(u.max()) < 1
    assert kstest(u.double().numpy(), "uniform").pvalue > 1e-3


def test_one_hot_rows_draw_their_token():
    probs = torch.zeros(4, 9)
    probs[torch.arange(4), torch.tensor([3, 0, 8, 5])] = 1.0
    assert draw(probs, torch.arange(4), torch.arange(4)).tolist() == [3, 0, 8, 5]
