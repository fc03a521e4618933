"""process_logits equals Hugging Face's warpers; sample is deterministic per generator and unbiased."""

import pytest
import torch

from trt_redrafter.decoding.sampling import process_logits, sample

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


def test_sample_deterministic_per_generator_and_batch_independent():
    probs = torch.softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(1)), -1)
    a = sample(probs, [torch.Generator().manual_seed(s) for s in (1, 2, 3)])
    b = sample(probs, [torch.Generator().manual_seed(s) for s in (1, 2, 3)])
    assert torch.equal(a, b)
    # row 1 alone with the same seed draws the same token as in the batch
    c = sample(probs[1:2], [torch.Generator().manual_seed(2)])
    assert int(c[0]) == int(a[1])
    # same call as HF's torch.multinomial on a generator in the same state
    g = torch.Generator().manual_seed(2)
    assert int(torch.multinomial(probs[1], 1, generator=g)[0]) == int(a[1])


def test_sample_frequencies():
    from scipy.stats import chisquare

    p = torch.tensor([0.5, 0.25, 0.125, 0.125])
    N = 4000
    g = [torch.Generator().manual_seed(0)] * N  # one generator drawn repeatedly
    draws = sample(p.expand(N, 4), g)
    counts = torch.bincount(draws, minlength=4).double()
    assert chisquare(counts.numpy(), (p.double() * N).numpy()).pvalue > 1e-3


def test_top_k_then_top_p_fast_path_and_ties_match_hf():
    # every nucleus row also has top-k, so only the top k_max get sorted; row 2 has ties at its k-th logit,
    # which keep more than k tokens (HF keeps ties), forcing the full-sort path
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 64, generator=g)
    logits[2, :10] = 4.0
    settings = [(1.0, 5, 0.9), (0.8, 12, 0.7), (1.0, 3, 0.95)]
    t, k, p = (torch.tensor([s[n] for s in settings]) for n in range(3))
    for rows in ([0, 1], [0, 1, 2]):
        probs = process_logits(logits[rows], t[rows], k[rows], p[rows])
        for n, r in enumerate(rows):
            torch.testing.assert_close(probs[n], hf_probs(logits[r], *settings[r]), rtol=1e-5, atol=1e-7)
