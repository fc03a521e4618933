"""Every Triton kernel in trt_redrafter.plugins against its PyTorch oracle: on the CPU under Triton's interpreter
(TRITON_INTERPRET=1, small shapes), on CUDA at realistic shapes (marked gpu). Plus the engine wired with the
kernels, greedy output equal to AR and HF, under the interpreter."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:  # must be set before the kernels are defined (triton.jit reads it)
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton", reason="the kernels need the triton package (pip install triton)")

from trt_redrafter import plugins  # noqa: E402
from trt_redrafter.decoding import acceptance, beam_search, sampling, tree  # noqa: E402
from trt_redrafter.model.attention import AttentionMeta, torch_tree_attention  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEV = torch.device("cuda" if CUDA else "cpu")
gpu = pytest.mark.skipif(not CUDA, reason="realistic shapes need a CUDA GPU")


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def random_beams(bs: int, nb: int, bl: int, V: int, seed: int) -> torch.Tensor:
    """Beams sharing their root, over a small vocabulary so prefixes collide (real dedup)."""
    beams = torch.randint(0, V, (bs, nb, bl), generator=gen(seed), device=DEV)
    beams[:, :, 0] = 1
    return beams


# ---- tree attention ---------------------------------------------------------------------------------------------

def _attention_case(bs, nh, nkv, D, page, nblk, T, ctx, dtype, seed):
    g = gen(seed)
    slots = (bs * nblk + 1) * page
    k = torch.randn(slots, nkv, D, generator=g, device=DEV).to(dtype)
    v = torch.randn(slots, nkv, D, generator=g, device=DEV).to(dtype)
    table = torch.randperm(bs * nblk + 1, generator=torch.Generator().manual_seed(seed))[:bs * nblk]
    table = table.view(bs, nblk).to(DEV)
    nb, dl = 3, (T - 1) // 3
    packed = tree.pack_beams(random_beams(bs, nb, dl + 1, 3, seed), pad_to=T)
    q = torch.randn(bs, T, nh, D, generator=g, device=DEV).to(dtype)
    ctx = torch.tensor(ctx, device=DEV)
    meta = AttentionMeta(positions=ctx[:, None] + packed.position_offsets, write_slots=ctx[:, None].expand(bs, T),
                         block_table=table, ctx_len=ctx, tree_mask=packed.mask, block_size=page)
    ref_meta = AttentionMeta(**{**meta.__dict__}).for_torch()
    return q, k, v, meta, ref_meta


@pytest.mark.parametrize("nh,nkv", [(4, 4), (4, 2), (4, 1)])
def test_tree_attention_matches_oracle(nh, nkv):
    q, k, v, meta, ref_meta = _attention_case(bs=3, nh=nh, nkv=nkv, D=32, page=8, nblk=6, T=7, ctx=[0, 5, 29],
                                              dtype=torch.float32, seed=nh + nkv)
    out = plugins.tree_attention(q, k, v, meta, 0.25)
    ref = torch_tree_attention(q.float(), k.float(), v.float(), ref_meta, 0.25)
    torch.testing.assert_close(out.float(), ref, rtol=1e-4, atol=1e-4)


def test_tree_attention_prompt_shape_and_odd_head_size():
    """A prompt step (causal, T > one query block) and a head size that is not a power of two."""
    bs, T, nh, nkv, D, page = 2, 40, 2, 1, 24, 16
    g = gen(5)
    k = torch.randn(8 * page, nkv, D, generator=g, device=DEV)
    v = torch.randn(8 * page, nkv, D, generator=g, device=DEV)
    q = torch.randn(bs, T, nh, D, generator=g, device=DEV)
    causal = torch.ones(T, T, dtype=torch.bool, device=DEV).tril()
    pos = torch.arange(T, device=DEV).expand(bs, T)
    meta = AttentionMeta(positions=pos, write_slots=pos, block_table=torch.tensor([[0, 1, 2], [3, 4, 5]], device=DEV),
                         ctx_len=torch.zeros(bs, dtype=torch.long, device=DEV), tree_mask=causal.expand(bs, T, T),
                         block_size=page)
    out = plugins.tree_attention(q, k, v, meta, D ** -0.5)
    ref = torch_tree_attention(q, k, v, AttentionMeta(**{**meta.__dict__}).for_torch(), D ** -0.5)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_tree_attention_rejects_bad_inputs():
    q, k, v, meta, _ = _attention_case(bs=1, nh=2, nkv=2, D=16, page=8, nblk=2, T=4, ctx=[3], dtype=torch.float32,
                                       seed=1)
    with pytest.raises(AssertionError, match="dtypes differ"):
        plugins.tree_attention(q.double(), k, v, meta, 1.0)
    with pytest.raises(AssertionError, match="q must be"):
        plugins.tree_attention(q[0], k, v, meta, 1.0)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("bs,T,ctx", [(1, 25, [300]), (8, 25, [17, 900, 1, 64, 63, 512, 1000, 5]), (4, 1, [1500] * 4)])
def test_tree_attention_realistic_bf16(bs, T, ctx):
    q, k, v, meta, ref_meta = _attention_case(bs=bs, nh=32, nkv=32, D=128, page=64, nblk=25, T=T, ctx=ctx,
                                              dtype=torch.bfloat16, seed=bs)
    out = plugins.tree_attention(q, k, v, meta, 128 ** -0.5)
    ref = torch_tree_attention(q.float(), k.float(), v.float(), ref_meta, 128 ** -0.5)
    err = (out.float() - ref).norm() / ref.norm()
    assert err < 1e-2, err


# ---- beams -> tree ------------------------------------------------------------------------------------------------

FIELDS = ("tokens", "lengths", "beam_positions", "position_offsets", "unpacker", "mask")


@pytest.mark.parametrize("nb,bl,V", [(3, 3, 3), (6, 5, 4), (4, 5, 50), (1, 4, 5), (5, 2, 2)])
def test_pack_beams_matches_oracle(nb, bl, V):
    beams = random_beams(7, nb, bl, V, seed=nb * 10 + bl)
    P = 1 + nb * (bl - 1)
    got, ref = plugins.pack_beams(beams, P), tree.pack_beams(beams, pad_to=P)
    for f in FIELDS:
        assert torch.equal(getattr(got, f), getattr(ref, f)), f


@gpu
@pytest.mark.gpu
def test_pack_beams_realistic():
    beams = random_beams(32, 6, 5, 6, seed=3)
    got, ref = plugins.pack_beams(beams, 25), tree.pack_beams(beams, pad_to=25)
    for f in FIELDS:
        assert torch.equal(getattr(got, f), getattr(ref, f)), f


# ---- acceptance and the draw --------------------------------------------------------------------------------------

@pytest.mark.parametrize("bs,nb,bl", [(50, 4, 5), (9, 1, 2), (20, 6, 5)])
def test_accept_tokens_matches_oracle(bs, nb, bl):
    beams = random_beams(bs, nb, bl, 3, seed=bs)
    node = torch.randint(0, 3, (bs, nb, bl), generator=gen(bs + 1), device=DEV)
    assert torch.equal(plugins.accept_tokens(beams, node).pack(), acceptance.accept_tokens(beams, node).pack())


@pytest.mark.parametrize("V", [7, 3000])
def test_draw_matches_oracle(V):
    g = gen(V)
    probs = torch.softmax(torch.randn(40, V, generator=g, device=DEV) * 2, -1)
    probs[:5] = torch.nn.functional.one_hot(torch.arange(5, device=DEV) % V, V).float()  # greedy rows
    seed = torch.randint(0, 2 ** 40, (40,), generator=g, device=DEV)
    pos = torch.randint(0, 5000, (40,), generator=g, device=DEV)
    assert torch.equal(plugins.draw(probs, seed, pos), sampling.draw(probs, seed, pos))


@gpu
@pytest.mark.gpu
def test_draw_and_accept_realistic():
    g = gen(0)
    probs = torch.softmax(torch.randn(800, 32000, generator=g, device=DEV), -1)
    seed, pos = torch.arange(800, device=DEV), torch.arange(800, device=DEV) + 100
    got, ref = plugins.draw(probs, seed, pos), sampling.draw(probs, seed, pos)
    bad = (got != ref).nonzero().flatten().tolist()
    if bad:  # report enough to tell rounding (close race values) from a wrong hash
        r = bad[0]
        u = sampling.uniform(sampling.row_keys(seed[r:r + 1], pos[r:r + 1], sampling.STREAM_TOKEN), 32000)[0]
        race = probs[r] / -torch.log(u)
        top = race.topk(2)
        pytest.fail(f"{len(bad)}/800 rows differ; row {r}: kernel {int(got[r])} (race {float(race[got[r]]):.9g}) vs "
                    f"oracle {int(ref[r])}; oracle's top-2 race {top.values.tolist()} at {top.indices.tolist()}")
    beams = random_beams(32, 6, 5, 4, seed=1)
    node = torch.randint(0, 4, (32, 6, 5), generator=g, device=DEV)
    assert torch.equal(plugins.accept_tokens(beams, node).pack(), acceptance.accept_tokens(beams, node).pack())


# ---- fused decoder-layer elementwise kernels -------------------------------------------------------------------------

def _layer_inputs(N, nh, nkv, D, dtype, seed):
    from trt_redrafter.rope import RotaryEmbedding

    g = gen(seed)
    rope = RotaryEmbedding(D, 10000.0, None, 512, 600, device=DEV, dtype=dtype)
    qkv = torch.randn(N, (nh + 2 * nkv) * D, generator=g, device=DEV).to(dtype)
    pos = torch.randint(0, 600, (N,), generator=g, device=DEV)
    slots = torch.randperm(64, generator=torch.Generator().manual_seed(seed))[:N].to(DEV)
    return rope, qkv, pos, slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nh,nkv,D", [(4, 2, 32), (3, 3, 16)])
def test_fused_layer_ops_match_oracle(dtype, nh, nkv, D):
    from trt_redrafter.model.llama import TorchLayerOps as ref_ops

    N, H = 5, 48
    rope, qkv, pos, slots = _layer_inputs(N, nh, nkv, D, dtype, seed=nh * D)
    caches = [torch.zeros(64, nkv, D, dtype=dtype, device=DEV) for _ in range(4)]
    q = plugins.fused.rope_write_kv(qkv, pos, rope.cos, rope.sin, nh, nkv, caches[0], caches[1], slots)
    q_ref = ref_ops.rope_write_kv(qkv, pos, rope.cos, rope.sin, nh, nkv, caches[2], caches[3], slots)
    # bf16: the same roundings as PyTorch, bit for bit; fp32 may fuse a multiply-add (1 ulp)
    tol = dict(rtol=0, atol=0) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(q, q_ref, **tol)
    torch.testing.assert_close(caches[0], caches[2], **tol)
    assert torch.equal(caches[1], caches[3])  # v is copied

    g = gen(1)
    res = torch.randn(N, H, generator=g, device=DEV).to(dtype)
    delta = torch.randn(N, H, generator=g, device=DEV).to(dtype)
    w = (1 + 0.1 * torch.randn(H, generator=g, device=DEV)).to(dtype)
    r_ref, h_ref = ref_ops.add_rms_norm(res, delta, w, 1e-6)
    r, h = plugins.fused.add_rms_norm(res.clone(), delta, w, 1e-6)
    assert torch.equal(r, r_ref)
    ulp = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-3)  # bf16: 1 ulp
    torch.testing.assert_close(h, h_ref, **ulp)
    gu = torch.randn(N, 2 * 40, generator=g, device=DEV).to(dtype)
    torch.testing.assert_close(plugins.fused.silu_mul(gu), ref_ops.silu_mul(gu), **ulp)


# ---- KV rewind ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("rows", [8, 4096])
def test_kv_mover_matches_oracle(rows):
    from trt_redrafter.runtime.step import move_kv

    L, slots, bs, bl = 3, 64, 4, 5
    g = gen(rows)
    caches = [torch.randn(slots, 2, rows // 2, generator=g, device=DEV) for _ in range(2 * L)]
    ref = [c.clone() for c in caches]
    # request b owns slots [16 b, 16 b + 16); context 3, accepted path packed [0, 2, 5, 7] (n = 3), then padding
    base = torch.arange(bs, device=DEV)[:, None] * 16 + 3
    path = torch.tensor([0, 2, 5, 7, 4], device=DEV)
    keep = torch.arange(bl, device=DEV) <= torch.tensor([3, 0, 4, 2], device=DEV)[:, None]
    src = base + torch.where(keep, path, torch.arange(bl, device=DEV))
    dst = base + torch.arange(bl, device=DEV)
    src[2, 4] = src[2, 3] + 1  # a full accept: every row moves, still increasing
    move_kv(ref, src, dst)
    plugins.KVMover(caches)(src, dst)
    for c, r in zip(caches, ref):
        assert torch.equal(c, r)


# ---- beam-search selection ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("warp", [50, None, 3])
@pytest.mark.parametrize("nin,nb,V", [(6, 6, 300), (1, 6, 300), (4, 4, 2000), (3, 5, 7)])
def test_beam_step_matches_oracle(warp, nin, nb, V):
    g = gen(nin * 100 + V)
    logits = torch.randn(5, nin, V, generator=g, device=DEV) * 3
    score = torch.randn(5, nin, generator=g, device=DEV) * 2
    got = plugins.beam_step(logits, score, nb, warp, True)
    ref = beam_search.select_beams(logits, score, nb, warp)
    assert torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2])
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[3], ref[3])
    fast = beam_search.select_beams_topk(logits, score, nb, warp, True)  # the PyTorch fast path, same contract
    assert torch.equal(fast[1], ref[1]) and torch.equal(fast[2], ref[2])


@gpu
@pytest.mark.gpu
def test_beam_step_realistic():
    g = gen(9)
    logits = torch.randn(32, 6, 32000, generator=g, device=DEV) * 4
    score = torch.randn(32, 6, generator=g, device=DEV)
    got = plugins.beam_step(logits, score, 6, 50)
    ref = beam_search.select_beams(logits, score, 6, 50)
    assert torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2])


# ---- weight-only int8 / int4 GEMM ---------------------------------------------------------------------------------

def _wo_case(n, k, bits, group, seed):
    from trt_redrafter.model.linear import QuantWeight
    g = torch.Generator().manual_seed(seed)
    lo, hi = (-128, 127) if bits == 8 else (-8, 7)
    q = torch.randint(lo, hi + 1, (n, k), generator=g, dtype=torch.int8)
    scales = 0.001 + 0.01 * torch.rand(n, -(-k // group), generator=g)
    return QuantWeight(q, scales, bits, group, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits,n,k,group", [(8, 72, 96, 96), (4, 40, 128, 64), (4, 33, 64, 64), (8, 48, 160, 32),
                                            (4, 24, 512, 128)])
def test_weight_only_gemm_matches_the_dequantized_weight(dtype, bits, n, k, group):
    """int8 / int4, per channel and per group, ragged N: every row against float64 x @ (q * s)^T; a row's bits do not
    depend on how many rows share the call (M = 1, 5, 17, 40 and 72: one to five row tiles, programs of one, two or
    four row tiles) nor on how many row tiles a program takes."""
    from trt_redrafter.plugins import weight_only
    w = _wo_case(n, k, bits, group, seed=bits + n)
    q, s = weight_only.pack(w.q, w.scales, bits, group)
    bk = weight_only.tiles_for(bits, group, k).block_k
    assert q.numel() == n * (k if bits == 8 else -(-k // bk) * bk // 2)
    x = torch.randn(72, k, generator=torch.Generator().manual_seed(n)).to(dtype)
    ref = x.double() @ (w.q.double() * w.scales.double().repeat_interleave(group, dim=1)[:, :k]).T
    out = weight_only.wo_linear(x.to(DEV), q.to(DEV), s.to(DEV), bits, group).cpu()
    assert out.dtype == dtype and out.shape == (72, n)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol * float(ref.abs().max()))
    for m in (1, 5, 17, 40):
        alone = weight_only.wo_linear(x[:m].contiguous().to(DEV), q.to(DEV), s.to(DEV), bits, group).cpu()
        assert torch.equal(alone, out[:m]), m
    for rows in (1, 2, 4):  # the same call with 1, 2 or 4 row tiles per program
        assert torch.equal(weight_only.wo_linear(x.to(DEV), q.to(DEV), s.to(DEV), bits, group, row_tiles=rows).cpu(),
                           out), rows


def test_weight_only_row_tiles_per_program_follow_the_kinds_tiles():
    """int4 takes as many row tiles as M fills from 17 rows on, up to 4; int8 (2 warps) 2 from 65 rows on (where the
    H200 measured each faster)."""
    from trt_redrafter.plugins.weight_only import TILES, row_tiles_for
    int4, int8 = TILES[(4, True)], TILES[(8, True)]
    assert [row_tiles_for(m, int4) for m in (1, 16, 17, 25, 32, 33, 64, 200)] == [1, 1, 2, 2, 2, 4, 4, 4]
    assert [row_tiles_for(m, int8) for m in (1, 25, 64, 65, 200)] == [1, 1, 1, 2, 2]


def test_weight_only_tiles_fit_their_block_k_to_the_group():
    from trt_redrafter.plugins import weight_only
    assert weight_only.tiles_for(4, 32, 4096).block_k == 32
    assert weight_only.tiles_for(8, 384, 4096).block_k == 128  # a group of 384: the largest halving that divides it
    assert weight_only.tiles_for(8, 4096, 4096) == weight_only.TILES[(8, True)]


def test_weight_only_tile_search_runs_and_applies_its_best(tmp_path, monkeypatch):
    """scripts/wo_gemm_tune.py on the tiny shapes (interpreted here): every kind gets a best tile, each candidate's
    output was checked against the dequantized weight, and --apply puts the best into the kernel's table."""
    import importlib.util
    from trt_redrafter.plugins import weight_only
    spec = importlib.util.spec_from_file_location("wo_gemm_tune", ROOT / "scripts" / "wo_gemm_tune.py")
    tune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune)
    monkeypatch.setattr(weight_only, "TILES", dict(weight_only.TILES))
    rows_before = {k: t[4:] for k, t in weight_only.TILES.items()}
    out = tmp_path / "tune.json"
    assert tune.main(["--shapes", "tiny", "--rows", "1,5", "--kinds", "int8,int4_g128", "--budget-s", "4",
                      "--rep-ms", "1", "--apply", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    best = {k: weight_only.Tiles(*v["best"]) for k, v in result["kinds"].items()}
    assert set(best) == {"int8", "int4_g128"}
    assert weight_only.TILES[(8, True)][:4] == best["int8"][:4]
    assert weight_only.TILES[(4, False)][:4] == best["int4_g128"][:4]
    assert {k: t[4:] for k, t in weight_only.TILES.items()} == rows_before  # row tiles per program kept
    assert all(len(times) == 4 for times in result["kinds"]["int8"]["times"].values())  # 2 shapes x 2 row counts


# ---- the engine on the kernels ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_engine_with_kernels_greedy_equals_ar_and_hf(tmp_path):
    """On the CPU this runs the kernels under the interpreter: the wiring (metadata, layouts) is what is tested."""
    from engine_utils import build_tiny_engines, greedy, hf_greedy, load_engine, random_prompts
    from trt_redrafter.runtime.generate import generate

    base, engines = build_tiny_engines(tmp_path, seed=4, num_beams=3, draft_len=2, hidden_size=64, num_heads=4,
                                       num_kv_heads=2)
    prompts = random_prompts(384, [5, 9], seed=4)
    engine = load_engine(engines[1], device=DEV.type, kernels="triton")
    assert engine.kernels == "triton"
    ar = [r.output_ids for r in generate(engine, prompts, greedy(10), "ar")]
    rd = [r.output_ids for r in generate(engine, prompts, greedy(10), "redrafter")]
    assert rd == ar == [hf_greedy(base, p, 10) for p in prompts]


def test_importing_the_model_and_runtime_leaves_triton_unimported():
    """triton.jit reads TRITON_INTERPRET when a kernel (triton.language's own included) is defined, and this file sets
    it before importing the kernels: a model or runtime module that imported triton (or dynamo, which imports it) at
    import would leave every interpreted kernel test of the suite failing ("Cannot call @triton.jit'd outside of the
    scope of a kernel"), as the CPU collectives' torch.compiler.disable once did."""
    import subprocess
    import sys

    code = ("import sys; import trt_redrafter.runtime.engine, trt_redrafter.model.llama, trt_redrafter.model.tp; "
            "print(sorted(m for m in ('triton', 'torch._dynamo', 'torch._inductor') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
