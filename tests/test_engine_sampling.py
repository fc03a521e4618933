"""`exact` acceptance inside the engine samples from the AR distribution (chi-square over many seeds), and a
deliberately biased acceptance rule fails the same test.

The target is a tiny model with top-k 3 sampling, so the first two tokens have at most 9 outcomes whose exact AR
probabilities come from Hugging Face forward passes. A test drafter proposes the target's two most likely next
tokens as the tree's first level (so verification both hits and misses), with random deeper tokens.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare

from engine_utils import HostDrafts, _hf_model, build_tiny_engines, load_engine, run_cli
from trt_redrafter.config import SamplingConfig
from trt_redrafter.decoding import acceptance, sampling
from trt_redrafter.runtime.generate import generate

TOP_K, TEMPERATURE, N = 3, 1.0, 2400
PROMPT = [17, 42, 99, 7]


def _target(base_dir, prompt):
    """(probs(prefix) of the top-k target, the exact joint distribution of the first two sampled tokens)."""
    hf = _hf_model(str(base_dir))

    @functools.lru_cache(maxsize=None)
    def cached(prefix: tuple[int, ...]) -> torch.Tensor:
        with torch.no_grad():
            logits = hf(torch.tensor([prefix])).logits[0, -1:].float()
        one = torch.ones(1)
        return sampling.process_logits(logits, one * TEMPERATURE, torch.tensor([TOP_K]), one)[0]

    def probs(prefix: list[int]) -> torch.Tensor:
        return cached(tuple(prefix))

    p1 = probs(prompt)
    joint = {}
    for t1 in p1.nonzero().flatten().tolist():
        p2 = probs(prompt + [t1])
        for t2 in p2.nonzero().flatten().tolist():
            joint[(t1, t2)] = float(p1[t1] * p2[t2])
    return probs, joint


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base, engines = build_tiny_engines(tmp_path_factory.mktemp("sampling"), seed=21, num_beams=3, draft_len=2,
                                       max_batch_size=32, num_heads=4, num_kv_heads=2, rnn=True)
    return (engines[1], *_target(base, PROMPT))


class Top2Proposer(HostDrafts):
    """Host proposer (test only): the target's two most likely next tokens as the tree's first level, random
    deeper tokens, so verification both hits and misses."""

    def __init__(self, engine_dir, probs):
        from trt_redrafter.checkpoint.engine_config import load_engine_config

        info = load_engine_config(engine_dir).checkpoint
        self.num_beams, self.draft_len = info.redrafter.num_beams, info.redrafter.draft_len_per_beam
        self.vocab, self.probs = info.model.vocab_size, probs
        self.g = torch.Generator().manual_seed(0)

    def beams(self, s):
        top2 = self.probs(s.prompt + s.output).topk(2).indices.tolist()
        beams = torch.randint(3, self.vocab, (self.num_beams, self.draft_len + 1), generator=self.g)
        beams[:, 0] = s.true_token
        for b in range(self.num_beams):
            beams[b, 1] = top2[b % 2]
        return beams


def _pvalue(engine_dir, probs, joint, accept_tokens=None, proposer=None, prompt=PROMPT, **runtime):
    """`proposer`: None drafts with Top2Proposer; a name drafts with the engine's own proposer of that name."""
    engine = load_engine(engine_dir, None if proposer else Top2Proposer(engine_dir, probs), **runtime)
    if accept_tokens is not None:  # the step's accept rule is swappable (StepKernels; the kernels use it)
        engine.steps.kernels.accept_tokens = accept_tokens
    params = [SamplingConfig(max_tokens=2, temperature=TEMPERATURE, top_k=TOP_K, seed=s, acceptance="exact")
              for s in range(N)]
    res = generate(engine, [prompt] * N, params, mode="redrafter", proposer=proposer)
    counts = {k: 0 for k in joint}
    for r in res:
        key = tuple(r.output_ids)
        assert key in counts, f"sampled {key}, which has probability 0 under top-k={TOP_K}"
        counts[key] += 1
    keys = sorted(joint)
    accepted = sum(r.accepted_draft_tokens for r in res)
    total = sum(joint.values())
    expected = [joint[k] / total * N for k in keys]
    return chisquare([counts[k] for k in keys], expected).pvalue, accepted


def test_exact_acceptance_follows_the_ar_distribution(setup):
    engine_dir, probs, joint = setup
    p, accepted = _pvalue(engine_dir, probs, joint)
    assert accepted > N // 4  # the tree's first level is taken often, so acceptance is really tested
    assert p > 1e-3, p


def test_exact_acceptance_with_ngram_drafts_follows_the_ar_distribution(tmp_path):
    """The N-gram proposer's drafts on an engine built from a base alone: the committed small model, whose bigram
    table (no context match after this prompt; `--ngram-when always` verifies them anyway) predicts its next token
    often enough to test acceptance."""
    base = Path(__file__).resolve().parents[1] / "models" / "small" / "base"
    plain = tmp_path / "ngram-engine"
    run_cli("build-engine", "--base-model", base, "--output", plain, "--backend", "torch", "--dtype", "float32",
            "--num-beams", 3, "--draft-len-per-beam", 2, "--max-batch-size", 32, "--max-input-len", 64,
            "--max-seq-len", 160, "--ngram-when", "always")
    prompt = [1, 321, 530, 265, 11]  # "def main(" in its tokenizer
    probs, joint = _target(base, prompt)
    p, accepted = _pvalue(plain, probs, joint, proposer="ngram", prompt=prompt)
    assert accepted > N // 8  # the drafts are taken often, so acceptance is really tested
    assert p > 1e-3, p


def test_a_biased_acceptance_rule_fails_the_same_test(setup):
    engine_dir, probs, joint = setup

    def biased(beams, node_tokens):
        """Lossy: when the root's draw matches no draft, take beam 0's first draft anyway."""
        acc = acceptance.accept_tokens(beams, node_tokens)
        miss = acc.num_accepted == 0
        acc.beam_index[miss] = 0
        acc.num_accepted[miss] = 1
        acc.next_token[miss] = node_tokens[miss, 0, 1]
        return acc

    p, _ = _pvalue(engine_dir, probs, joint, accept_tokens=biased)
    assert p < 1e-6, p
