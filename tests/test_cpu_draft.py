"""The drafter's whole beam search in one CPU kernel (`beam_draft`, trt_redrafter/cpu/draft.cpp, run by
runtime/drafter.py `FusedSearch`) against its unfused oracle, `decoding.beam_search.beam_search` with
`select_beams_topk` over `cpu.topk` (what the engine's CPU kernels ran before): the same beams, and the same scores up
to the exp's last bit, for float and int8-input layers, float32 and bfloat16 drafters, a draft vocabulary or none,
every beam count up to the bound and a few depths, and a search stopped early (`depth_rows`); where it does not apply,
the engine keeps the oracle. The engine
runs it by default on the CPU kernels: its drafts, steps and tokens equal those of the oracle's search, and greedy
output equals AR, eager and compiled (tests/test_compiled.py, test_tp.py)."""

from __future__ import annotations

import functools

import pytest
import torch

from engine_utils import SMALL, load_engine
from trt_redrafter import cpu
from trt_redrafter.config import DrafterConfig, SamplingConfig
from trt_redrafter.decoding.beam_search import LOG_ZERO, beam_search, select_beams_topk
from trt_redrafter.model.drafter import DrafterRank
from trt_redrafter.model.tp import Dist
from trt_redrafter.runtime.drafter import APPLE_WARP_TOP_K, BeamDrafter, FusedSearch
from trt_redrafter.runtime.generate import generate


@pytest.fixture(autouse=True)
def _kernels():
    if not cpu.available(torch.float32):
        pytest.skip("this CPU has no AVX-512")
    cpu.ops()  # on such a CPU the kernels must build: a failure here is a failure


H, V = 64, 3000


def _drafter(dtype: torch.dtype, weights: str, exit_dim: int, draft_vocab: int, seed: int,
             linear: str = "avx512") -> DrafterRank:
    if weights and not cpu.vnni_available():
        pytest.skip("int8 inputs need AVX512-VNNI")
    if dtype == torch.bfloat16 and not cpu.available(torch.bfloat16):
        pytest.skip("this CPU has no AVX512-BF16")
    g = torch.Generator().manual_seed(seed)
    cfg = DrafterConfig(vocab_size=V, hidden_size=H, exit_dim=exit_dim, num_draft_layers=2, rnn=True,
                        draft_vocab_size=draft_vocab)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale / shape[-1] ** 0.5

    t = {"drafter.rnn_w.weight": rnd(H, H, scale=2), "drafter.rnn_u.weight": rnd(H, H, scale=2),
         "drafter.rnn_u.bias": rnd(H, scale=4), "drafter.lm_head.weight": rnd(draft_vocab or V, exit_dim, scale=8)}
    for j in range(2):
        t[f"drafter.layers.{j}.linear.weight"] = rnd(exit_dim, exit_dim, scale=2)
        t[f"drafter.layers.{j}.linear.bias"] = rnd(exit_dim, scale=4)
    if exit_dim != 2 * H:
        t["drafter.input_proj.weight"] = rnd(exit_dim, 2 * H, scale=2)
        t["drafter.input_proj.bias"] = rnd(exit_dim, scale=4)
    if draft_vocab:
        t["drafter.draft_vocab"] = torch.randperm(V, generator=g)[:draft_vocab].sort().values
    return DrafterRank(cfg, t, Dist(0, 1, torch.device("cpu")), dtype, linear=linear, weights=weights)


def _oracle(d: DrafterRank, emb: torch.Tensor, h, tok, nb: int, dl: int, depth_rows=None):
    return beam_search(d, lambda ids: torch.nn.functional.embedding(ids, emb), h, tok, nb, dl,
                       warp_top_k=APPLE_WARP_TOP_K, keep_log_probs=False,
                       select=functools.partial(select_beams_topk, topk=cpu.topk), depth_rows=depth_rows)


# (drafter dtype, drafter weights, exit_dim (2H: no input_proj), draft vocabulary size, base dtype)
DRAFTERS = [(torch.float32, "", 96, 0, torch.float32), (torch.bfloat16, "", 2 * H, 0, torch.float32),
            (torch.bfloat16, "w8a8", 96, 500, torch.float32), (torch.float32, "w8a8", 2 * H, 0, torch.float32),
            (torch.bfloat16, "w4a8", 96, 0, torch.bfloat16), (torch.bfloat16, "w8a8", 2 * H, 1000, torch.bfloat16)]


@pytest.mark.parametrize("dtype,weights,exit_dim,draft_vocab,base", DRAFTERS)
def test_the_fused_search_drafts_the_oracles_beams(dtype, weights, exit_dim, draft_vocab, base):
    d = _drafter(dtype, weights, exit_dim, draft_vocab, seed=exit_dim + draft_vocab)
    g = torch.Generator().manual_seed(1)
    emb = torch.randn(V, H, generator=g).to(base)
    fused = FusedSearch.of(d, emb, APPLE_WARP_TOP_K, num_beams=4)
    assert fused is not None
    drafted = 0
    # batch 6 x 4 beams: 24 rows, six passes of the int8-input layers' 4-row tiles
    for bs, nb, dl in [(1, 1, 1), (1, 4, 4), (3, 2, 3), (2, 3, 4), (6, 4, 4)]:
        h = torch.randn(bs, H, generator=g).to(base)
        tok = torch.randint(0, V, (bs,), generator=g)
        ref = _oracle(d, emb, h, tok, nb, dl)
        for bound in {nb, 4}:  # the count itself, and a larger bound (a compiled step's unbacked beam count)
            got = fused(h, tok, nb, bound, dl)
            assert got.beams.shape == ref.beams.shape and got.scores.shape == ref.scores.shape
            assert torch.equal(got.beams, ref.beams), (bs, nb, dl, bound)
            torch.testing.assert_close(got.scores, ref.scores, rtol=1e-5, atol=2e-4)
            drafted += got.beams[:, :, 1:].numel()
        if draft_vocab:
            assert torch.isin(ref.beams[:, :, 1:], d.draft_vocab).all()
    assert drafted > 0


@pytest.mark.parametrize("dtype,weights,exit_dim,draft_vocab,base", [DRAFTERS[0], DRAFTERS[4]])
def test_the_fused_search_stops_at_the_oracles_depth(dtype, weights, exit_dim, draft_vocab, base):
    """A search stopped at depth d of dl (`depth_rows`: all rows up to d, none after) is the oracle's stopped search:
    the d-step search's beams and scores, then each beam's last token repeated at LOG_ZERO (not the whole search's
    drafts)."""
    d = _drafter(dtype, weights, exit_dim, draft_vocab, seed=7)
    g = torch.Generator().manual_seed(2)
    emb = torch.randn(V, H, generator=g).to(base)
    fused = FusedSearch.of(d, emb, APPLE_WARP_TOP_K, num_beams=4)
    assert fused is not None
    for bs, nb, dl, depth in [(1, 4, 4, 1), (2, 4, 4, 2), (3, 2, 4, 3), (2, 3, 3, 3), (1, 1, 3, 1)]:
        h = torch.randn(bs, H, generator=g).to(base)
        tok = torch.randint(0, V, (bs,), generator=g)
        rows = [torch.arange(bs * nb if t < depth else 0) for t in range(1, dl)]
        ref = _oracle(d, emb, h, tok, nb, dl, rows)
        got = fused(h, tok, nb, 4, dl, rows)
        assert torch.equal(got.beams, ref.beams), (bs, nb, dl, depth)
        torch.testing.assert_close(got.scores, ref.scores, rtol=1e-5, atol=2e-4)
        assert (got.scores[:, :, depth:] == LOG_ZERO).all() and (got.scores[:, :, :depth] > LOG_ZERO).any()
        own = fused(h, tok, nb, 4, depth)
        assert torch.equal(got.beams[:, :, :depth + 1], own.beams) and torch.equal(got.scores[:, :, :depth], own.scores)
        assert torch.equal(got.beams[:, :, depth + 1:], own.beams[:, :, -1:].expand(-1, -1, dl - depth))
        if depth < dl:
            assert not torch.equal(fused(h, tok, nb, 4, dl).beams, got.beams)


def test_the_fused_search_applies_only_where_it_computes_the_oracles_search():
    emb = torch.randn(V, H)
    assert FusedSearch.of(_drafter(torch.float32, "", 96, 0, 0), emb, APPLE_WARP_TOP_K, 4) is not None
    # another state update, another layer kernel, a draft vocabulary the warp keeps whole, more beams than the warp
    trtllm = _drafter(torch.float32, "", 96, 0, 0)
    trtllm.semantics = "trtllm-0.13"
    torch_layers = _drafter(torch.float32, "", 96, 0, 0, "torch")
    for d, warp, nb in [(trtllm, APPLE_WARP_TOP_K, 4), (torch_layers, APPLE_WARP_TOP_K, 4),
                        (_drafter(torch.float32, "", 96, 40, 0), APPLE_WARP_TOP_K, 4),
                        (_drafter(torch.float32, "", 96, 0, 0), 3, 4)]:
        assert FusedSearch.of(d, emb, warp, nb) is None
    # the `apple` acceptance rule needs the drafter's distributions: the device drafter keeps the oracle's search
    d = _drafter(torch.float32, "", 96, 0, 0)
    drafter = BeamDrafter(d, lambda ids: torch.nn.functional.embedding(ids, emb), 4, 3,
                          functools.partial(select_beams_topk, topk=cpu.topk), embedding=emb)
    assert drafter.fused is not None
    h, tok = torch.randn(2, H), torch.tensor([5, 7])
    assert drafter.draft(h, tok, keep_log_probs=True).log_probs is not None
    assert drafter.draft(h, tok, keep_log_probs=False).log_probs is None


@pytest.mark.skipif(not (SMALL / "drafter" / "model.safetensors").is_file(), reason="models/small not trained")
def test_the_engine_drafts_with_the_fused_search_and_gets_the_oracles_steps(tmp_path):
    """The engine's device drafter on the CPU kernels is the fused search; with the oracle's search in its place
    (the same engine, `fused` cleared) every request takes the same steps and emits the same tokens, which equal
    AR's: drafting the whole depth, and drafting 2 tokens deep of 4 (`--draft-depth 2`)."""
    from engine_utils import build_small_engine
    from test_drafter_dtype import _prompts

    en = build_small_engine(tmp_path, num_beams=4, draft_len=4, max_batch_size=4, max_input_len=128,
                            max_seq_len=256)
    engine = load_engine(en, kernels="cpu", speculate="full")
    search = engine.device_drafter.fused
    assert search is not None and engine.launcher.depth_options == [1, 2, 3, 4]
    params = SamplingConfig(max_tokens=40)
    ar = [r.output_ids for r in generate(engine, _prompts(), params, mode="ar")]
    for depth in (4, 2):
        engine.policy.depth_options = [depth]
        engine.device_drafter.fused = search
        fused = generate(engine, _prompts(), params, mode="redrafter")
        engine.device_drafter.fused = None
        oracle = generate(engine, _prompts(), params, mode="redrafter")
        assert [r.output_ids for r in fused] == [r.output_ids for r in oracle] == ar, depth
        assert [r.steps for r in fused] == [r.steps for r in oracle], depth
        assert sum(r.accepted_draft_tokens for r in fused) > 0, depth
        # `draft_tokens` adds up the depth of the deepest node each tree step verified: at most `depth` a step, but
        # the first tree's (drafted after the prompt, whole: 4 deep)
        assert all(r.draft_tokens <= depth * r.steps + 4 - depth for r in fused), \
            (depth, [(r.draft_tokens, r.steps) for r in fused])
