"""The CPU linear paths over packed weights (model/linear.py, RuntimeConfig.linear): oneDNN's prepacked GEMM and the
project's AVX-512 kernel (trt_redrafter/cpu/linear.cpp), each against `F.linear`, a row's bits independent of how many
rows share the GEMM, the op under torch.compile, and on tiny engines greedy ReDrafter == AR with it (bf16 and fp32,
eager and compiled) and AR with it == AR with `F.linear`.

The engines' MLP is 1536 wide, so the down-projection has K = 1536: there oneDNN's one-row kernel rounds differently
from its many-row one, which is what `linear.MIN_ROWS` padding is for; the AVX-512 kernel needs no padding.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from engine_utils import OracleProposer, build_tiny_engines, greedy, load_engine, random_prompts
from trt_redrafter import cpu
from trt_redrafter.config import RuntimeConfig
from trt_redrafter.errors import UserError
from trt_redrafter.model import linear as lin
from trt_redrafter.model.attention import AttentionMeta, causal_mask
from trt_redrafter.runtime.generate import generate
from trt_redrafter.runtime.sequence import RequestSpec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SHAPES = [(960, 576), (576, 1536), (200, 64)]  # (out, in): SmolLM2's qkv and down-projection, a tiny one
ROW_COUNTS = list(range(1, 21)) + [26, 32, 52, 64]  # AR (bs), and trees of up to 26 tokens for 1-2 requests
MAX_NEW = 24
PROMPT_LENS = [5, 11, 3, 8, 14]  # more prompts than max_batch_size=4: batches of 4 and of 1


PACKED = ["onednn", "avx512"]  # the implementations over packed weights


def _need(dtype: torch.dtype, impl: str = "onednn") -> None:
    if impl == "onednn" and not lin.onednn_available(dtype):
        pytest.skip(f"no native oneDNN {dtype} GEMM in this PyTorch build / on this CPU")
    if impl == "avx512":
        if not cpu.available(dtype):
            pytest.skip(f"this CPU has no AVX-512 for {dtype} (float32: AVX-512F, bfloat16: AVX512-BF16)")
        cpu.ops()  # on such a CPU the kernel must build: a failure here is a failure


def _auto(dtype: torch.dtype) -> str:
    """What `--linear auto` takes on this CPU for float layers of `dtype`."""
    if lin.amx_available(dtype) and lin.rows_invariant(dtype):
        return "onednn"
    return "avx512" if cpu.available(dtype) else "onednn" if lin.onednn_available(dtype) else "torch"


@pytest.fixture
def threads(request):
    n = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(n)


# ---- the op ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", PACKED)
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("shape", SHAPES + [(33, 577)])  # + odd sizes: a partial panel, an odd K (bf16 k pairs)
def test_prepacked_linear_matches_f_linear(dtype, shape, impl):
    dt = DTYPES[dtype]
    _need(dt, impl)
    g = torch.Generator().manual_seed(0)
    w = (0.05 * torch.randn(shape, generator=g)).to(dt)
    b = torch.randn(shape[0], generator=g).to(dt)
    tol = dict(rtol=1e-5, atol=1e-5) if dt == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    for bias in (None, b):
        packed, plain = lin.Linear(w.clone(), bias, impl=impl), lin.Linear(w.clone(), bias, impl="torch")
        assert packed.weight is None and plain.packed is None
        for lead in [(1,), (3,), (17,), (2, 5)]:  # one row (padded), a few, a batch of trees ([bs, T, in])
            x = torch.randn(*lead, shape[1], generator=g).to(dt)
            y = packed(x)
            assert y.shape == (*lead, shape[0]) and y.dtype == dt
            ref = F.linear(x.float(), w.float(), None if bias is None else bias.float())
            torch.testing.assert_close(y.float(), ref, **tol)
            torch.testing.assert_close(y, plain(x), **tol)


@pytest.mark.parametrize("impl", PACKED)
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("shape", SHAPES)
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(dtype, shape, threads, impl):
    """Row i of a GEMM over M rows is bitwise row i of one over 64 rows, for every M (1 included: onednn pads it),
    and a row alone or in any window of 5 equals itself in the big GEMM: an AR step's token and a tree step's get one
    value."""
    dt = DTYPES[dtype]
    _need(dt, impl)
    g = torch.Generator().manual_seed(1)
    w = (0.05 * torch.randn(shape, generator=g)).to(dt)
    layer = lin.Linear(w, impl=impl)
    X = torch.randn(64, shape[1], generator=g).to(dt)
    full = layer(X)
    assert [M for M in ROW_COUNTS if not torch.equal(layer(X[:M]), full[:M])] == []
    assert [i for i in range(64) if not torch.equal(layer(X[i:i + 1])[0], full[i])] == []
    assert [i for i in range(0, 59, 3) if not torch.equal(layer(X[i:i + 5]), full[i:i + 5])] == []


@pytest.mark.slow
@pytest.mark.parametrize("impl", PACKED)
def test_compiled_op_equals_eager_for_every_row_count(impl):
    """Dynamo traces the op (`trt_redrafter::onednn_linear`, `trt_redrafter_cpu::linear`) into one graph (fullgraph)
    with a dynamic row count; inductor calls it as an external kernel around its own fused code: same bits as eager."""
    _need(torch.bfloat16, impl)
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(2)
    up = lin.Linear((0.05 * torch.randn(1536, 64, generator=g)).bfloat16(), impl=impl)
    down = lin.Linear((0.05 * torch.randn(64, 1536, generator=g)).bfloat16(),
                      torch.randn(64, generator=g).bfloat16(), impl=impl)

    def mlp(x):
        return down(F.silu(up(x))) + x

    compiled = torch.compile(mlp, fullgraph=True)
    with torch.inference_mode():
        for M in (1, 3, 17):
            x = torch.randn(M, 64, generator=g).bfloat16()
            if M > 1:
                torch._dynamo.mark_dynamic(x, 0)
            assert torch.equal(compiled(x), mlp(x)), M


def _need_vnni() -> None:
    if not cpu.vnni_available():
        pytest.skip("this CPU has no AVX512-VNNI (linear_w8a8's byte dot products)")


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("shape", SHAPES + [(33, 577), (8192, 512)])  # + a partial panel and K % 8, a drafter head
def test_w8a8_kernel_equals_its_reference_bit_for_bit(dtype, shape, bits):
    """int8 (or int4) weights and per-row int8 activations (`linear_w8a8`): the same bits as `cpu.w8a8_reference`
    (integer sums are exact, the scaling one fixed order), with and without bias, a zero row included, and a row's
    bits do not depend on the rows beside it."""
    from trt_redrafter.checkpoint.quantization import quantize_per_channel

    _need_vnni()
    g = torch.Generator().manual_seed(5)
    n, k = shape
    q, s = quantize_per_channel(torch.randn(n, k, generator=g), bits, torch.float32)
    assert bits == 8 or (q.min() == -8 and q.max() == 7)  # every nibble value, the extremes included
    packed, colsum, scales = cpu.pack_w8a8(q, s, bits)
    assert packed.numel() == -(-n // 16) * 16 * -(-k // (32 // bits)) * (32 // bits) * bits // 8
    x = (3 * torch.randn(37, k, generator=g)).to(DTYPES[dtype])
    x[5] = 0
    op = torch.ops.trt_redrafter_cpu.linear_w8a8
    for bias in (None, torch.randn(n, generator=g)):
        y = op(x, packed, colsum, scales, n, bias, bits)
        assert y.dtype == x.dtype and y.shape == (37, n)
        assert torch.equal(y, cpu.w8a8_reference(x, q, s, bias))
        for start, m in ((0, 1), (5, 1), (3, 4), (30, 7)):
            assert torch.equal(op(x[start:start + m].clone(), packed, colsum, scales, n, bias, bits),
                               y[start:start + m])


def test_w8a8_layer_runs_the_byte_kernel_where_it_can_and_weight_only_elsewhere():
    """A `QuantWeight` with `activations` runs `linear_w8a8` under the avx512 kernels (on a VNNI CPU) at any number of
    rows, each row's result independent of the others, and as the int8 weight-only layer elsewhere (torch: its
    dequantized weight)."""
    from trt_redrafter.checkpoint.quantization import quantize_per_channel

    _need_vnni()
    g = torch.Generator().manual_seed(6)
    w, b = torch.randn(96, 64, generator=g).bfloat16(), torch.randn(96, generator=g).bfloat16()
    q, s = quantize_per_channel(w, 8, torch.bfloat16)
    x = torch.randn(3, 2, 64, generator=g).bfloat16()
    byte = lin.Linear(lin.QuantWeight(q, s, 8, 64, torch.bfloat16, activations=True), b, impl="avx512")
    assert byte.path == "avx512 int8 weights, int8 activations (VNNI)" and byte.quant is None
    assert torch.equal(byte(x), cpu.w8a8_reference(x.reshape(6, 64), q, s, b.float()).view(3, 2, 96))
    many = torch.randn(37, 64, generator=g).bfloat16()  # passes of 4 rows and a remainder
    assert torch.equal(byte(many), cpu.w8a8_reference(many, q, s, b.float()))
    assert torch.equal(byte(many[:5]), byte(many)[:5])
    plain = lin.Linear(lin.QuantWeight(q, s, 8, 64, torch.bfloat16, activations=True), b, impl="torch")
    assert plain.w8a8 is None and plain.path == "torch bfloat16"
    assert torch.equal(plain(x), F.linear(x, (q.float() * s.float()).bfloat16(), b))


def test_resolve_linear():
    cpu_dev, cuda = torch.device("cpu"), torch.device("cuda")
    assert lin.resolve_linear("torch", cpu_dev, torch.float32) == "torch"
    assert lin.resolve_linear("auto", cuda, torch.bfloat16) == "torch"
    for impl in PACKED:
        with pytest.raises(UserError, match=f"--linear {impl} runs on the CPU"):
            lin.resolve_linear(impl, cuda, torch.float32)
    for dt in DTYPES.values():
        assert lin.resolve_linear("auto", cpu_dev, dt) == _auto(dt)
        assert lin.resolve_linear("auto", cpu_dev, dt, quantized=True) == (  # weight-only layers: never oneDNN's
            "avx512" if cpu.available(dt) else "onednn" if lin.onednn_available(dt) else "torch")
    assert lin.resolve_linear("onednn", cpu_dev, torch.float32) == "onednn"  # asked for: not replaced by avx512
    if not lin.onednn_available(torch.float16):
        with pytest.raises(UserError, match="no native oneDNN torch.float16 GEMM"):
            lin.resolve_linear("onednn", cpu_dev, torch.float16)
    with pytest.raises(UserError, match="--linear avx512: this CPU has no AVX-512 for torch.float16"):
        lin.resolve_linear("avx512", cpu_dev, torch.float16)
    with pytest.raises(UserError, match=r"runtime.linear: expected one of auto, torch, onednn, avx512, got 'mkl'"):
        RuntimeConfig.from_dict({"linear": "mkl"})


def test_rows_invariant_sees_a_gemm_whose_rows_depend_on_the_row_count(monkeypatch):
    """The check `auto` runs before it takes oneDNN on AMX tiles (model/linear.py: rows_invariant), on this machine's
    real oneDNN: padded as `onednn_linear` pads, a row's bits hold; unpadded, oneDNN's one-row kernel reduces K = 1536
    in another order than its many-row one, and the check must say so."""
    _need(torch.float32)
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(96, 1536, generator=g), torch.randn(8, 1536, generator=g)
    packed = lin.prepack(w)
    lin._rows_invariant.cache_clear()
    assert lin.rows_invariant(torch.float32)
    one_row = torch.ops.mkldnn._linear_pointwise(x[:1].clone(), packed, None, "none", [], "")
    if torch.equal(one_row, torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")[:1]):
        pytest.skip("this oneDNN's one-row kernel rounds as its many-row one: nothing unpadded to catch")
    monkeypatch.setattr(lin, "min_rows", lambda dtype: 1)
    lin._rows_invariant.cache_clear()
    try:
        assert not lin.rows_invariant(torch.float32)
    finally:
        lin._rows_invariant.cache_clear()


def test_auto_keeps_avx512_where_a_mock_amx_gemm_is_not_row_invariant(monkeypatch, caplog):
    """A CPU with AMX tiles (mocked: this one has none) whose oneDNN failed the row check: auto keeps the AVX-512 kernel
    and says why; with the check passing it takes oneDNN for float bf16 layers only (weight-only layers stay in
    linear_wo, fp32 has no AMX path)."""
    bf16, cpu_dev = torch.bfloat16, torch.device("cpu")
    _need(bf16)
    monkeypatch.setattr(lin, "amx_available", lambda dtype: dtype == bf16)
    monkeypatch.setattr(lin, "rows_invariant", lambda dtype: False)
    package = logging.getLogger("trt_redrafter")  # it does not propagate to the root logger caplog reads
    package.addHandler(caplog.handler)
    try:
        assert lin.resolve_linear("auto", cpu_dev, bf16) == ("avx512" if cpu.available(bf16) else "onednn")
    finally:
        package.removeHandler(caplog.handler)
    assert "keep the AVX-512 kernel" in caplog.text
    monkeypatch.setattr(lin, "rows_invariant", lambda dtype: True)
    assert lin.resolve_linear("auto", cpu_dev, bf16) == "onednn"
    assert lin.resolve_linear("auto", cpu_dev, bf16, quantized=True) == ("avx512" if cpu.available(bf16) else "onednn")
    assert lin.resolve_linear("auto", cpu_dev, torch.float32) == _auto(torch.float32)
    assert lin.resolve_linear("avx512", cpu_dev, bf16) == "avx512" or not cpu.available(bf16)  # asked for: kept


# ---- engines ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=sorted(DTYPES))
def tiny(request, tmp_path_factory):
    _need(DTYPES[request.param])
    _, engines = build_tiny_engines(tmp_path_factory.mktemp(f"linear-{request.param}"), seed=41, num_beams=4,
                                    draft_len=3, dtype=request.param, kv_block_size=16, num_heads=4, num_kv_heads=2,
                                    intermediate_size=1536)
    engine_dir = engines[1]
    prompts = random_prompts(384, PROMPT_LENS, seed=41)
    impls = ["torch"] + [impl for impl in PACKED if impl == "onednn" or cpu.available(DTYPES[request.param])]
    ar = {impl: [r.output_ids for r in generate(load_engine(engine_dir, linear=impl), prompts, greedy(MAX_NEW), "ar")]
          for impl in impls}
    return dict(dtype=request.param, engine_dir=engine_dir, prompts=prompts, ar=ar)


def _need_ar(tiny, impl: str) -> list[list[int]]:
    _need(DTYPES[tiny["dtype"]], impl)
    return tiny["ar"][impl]


def test_engine_records_its_linear_choice(tiny):
    assert load_engine(tiny["engine_dir"]).linear == _auto(DTYPES[tiny["dtype"]])
    assert load_engine(tiny["engine_dir"], linear="torch").linear == "torch"


def test_mock_amx_bf16_engine_runs_onednn_on_tile_high_inputs_and_equals_ar(tiny, monkeypatch):
    """What `auto` does on a CPU with AMX tiles (mocked: this one has none, so oneDNN's AVX-512 kernels stand in for
    its tile kernels): a bf16 engine's base and drafter layers run oneDNN, every call's input padded to AMX_ROWS rows
    (an AR step's one row as much as a tree's), and greedy ReDrafter with drafts accepted equals AR, which equals AR
    padded to MIN_ROWS. On a CPU with AMX the unmocked tests above run the same padding on its tiles."""
    if tiny["dtype"] != "bfloat16":
        pytest.skip("oneDNN runs bf16 on AMX tiles; fp32 keeps the AVX-512 kernel")
    ar4 = _need_ar(tiny, "onednn")
    monkeypatch.setattr(lin, "amx_available", lambda dtype: dtype == torch.bfloat16)
    lin._rows_invariant.cache_clear()
    rows = []
    real = torch.ops.mkldnn._linear_pointwise

    def spy(x, *args):
        rows.append(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    try:
        engine = load_engine(tiny["engine_dir"])
        assert engine.linear == "onednn" and engine.drafter.linear == "onednn"
        assert set(lin.linear_paths(engine.model, engine.drafter)) == {"onednn bfloat16 (AMX tiles)"}
        rows.clear()
        ar = [r.output_ids for r in generate(engine, tiny["prompts"], greedy(MAX_NEW), "ar")]
        assert rows and min(rows) == lin.AMX_ROWS
        assert ar == ar4
        oracle = OracleProposer(tiny["engine_dir"], dict(enumerate(ar)), corrupt_every=2)
        res = generate(load_engine(tiny["engine_dir"], oracle), tiny["prompts"], greedy(MAX_NEW), "redrafter")
        assert [r.output_ids for r in res] == ar
        assert sum(r.accepted_draft_tokens for r in res) > 0
        own = generate(engine, tiny["prompts"], greedy(MAX_NEW), "redrafter")  # its own drafter, on oneDNN too
        assert [r.output_ids for r in own] == ar and sum(r.draft_tokens for r in own) > 0
    finally:
        lin._rows_invariant.cache_clear()


def test_bench_engine_names_each_layers_kernel(tiny):
    engine = load_engine(tiny["engine_dir"], linear="torch")
    paths = lin.linear_paths(engine.model, engine.drafter)
    layers = [m for m in (*engine.model.modules(), *engine.drafter.modules()) if isinstance(m, lin.Linear)]
    assert paths == {f"torch {tiny['dtype']}": len(layers)}


@pytest.mark.parametrize("impl", PACKED)
@pytest.mark.parametrize("corrupt_every", [None, 0, 2])
def test_greedy_redrafter_equals_ar(tiny, corrupt_every, impl):
    """The engine's own drafter (None), and an oracle drafter forcing long (0) and partial (2) acceptances, so that
    accepted tokens' K/V and logits come from tree steps of up to 13 tokens, AR's from one-row steps."""
    ar = _need_ar(tiny, impl)
    proposer = None if corrupt_every is None else \
        OracleProposer(tiny["engine_dir"], dict(enumerate(ar)), corrupt_every=corrupt_every)
    engine = load_engine(tiny["engine_dir"], proposer, linear=impl)
    res = generate(engine, tiny["prompts"], greedy(MAX_NEW), mode="redrafter")
    assert [r.output_ids for r in res] == ar
    if corrupt_every == 0:
        assert min(r.tokens_per_step for r in res) > 1.5


@pytest.mark.parametrize("impl", PACKED)
def test_packed_ar_matches_torch_ar(tiny, impl):
    """fp32: the same tokens. Both dtypes: the first AR step's logits within the dtype's rounding."""
    ar = _need_ar(tiny, impl)
    if tiny["dtype"] == "float32":
        assert ar == tiny["ar"]["torch"]
    logits = {}
    for name in (impl, "torch"):
        engine = load_engine(tiny["engine_dir"], linear=name)
        seq = engine.new_sequence(RequestSpec(tiny["prompts"][1], greedy(4)))
        engine.step([seq])  # prompt
        logits[name] = _ar_step_logits(engine, seq)
    tol = dict(rtol=1e-4, atol=1e-4) if tiny["dtype"] == "float32" else dict(rtol=0.05, atol=0.05)
    torch.testing.assert_close(logits[impl], logits["torch"], **tol)


@pytest.mark.parametrize("impl", PACKED)
def test_hidden_states_do_not_depend_on_tokens_per_step(tiny, impl):
    """The heart of ReDrafter == AR, below the tokens: 16 tokens fed one per step and all in one step (a chain) give
    every token bitwise the same final hidden state. Needs oneDNN's padding (linear.MIN_ROWS) and the attention's
    (attention.PAD_QUERY_ROWS: the CPU SDPA kernel rounds 1-3 query rows otherwise than 4 or more)."""
    _need_ar(tiny, impl)
    model = load_engine(tiny["engine_dir"], linear=impl).model
    differ = 0
    for seed in range(12):
        g = torch.Generator().manual_seed(seed)
        prompt, chain = torch.randint(3, 384, (1, 6), generator=g), torch.randint(3, 384, (1, 16), generator=g)
        kv = _fresh_kv(model)
        _forward(model, kv, prompt, 0)
        together = _forward(model, kv, chain, 6)[0]  # [16, H]
        kv = _fresh_kv(model)
        _forward(model, kv, prompt, 0)
        alone = torch.cat([_forward(model, kv, chain[:, t:t + 1], 6 + t)[0] for t in range(16)])
        differ += sum(not torch.equal(a, b) for a, b in zip(alone, together))
    assert differ == 0


def _ar_step_logits(engine, seq) -> torch.Tensor:
    captured = {}
    orig = engine.model.logits

    def spy(hidden):
        out = orig(hidden)
        captured["logits"] = out.reshape(-1, out.shape[-1])[0].float().clone()
        return out

    engine.model.logits = spy
    try:
        seq.mode = "ar"
        engine.step([seq])
    finally:
        engine.model.logits = orig
    return captured["logits"]


KV_SLOTS, BLOCK = 128, 16


def _fresh_kv(model):
    shape = (KV_SLOTS, model.nkv, model.D)
    return ([torch.zeros(shape, dtype=model.dtype) for _ in model.layers],
            [torch.zeros(shape, dtype=model.dtype) for _ in model.layers])


@torch.inference_mode()
def _forward(model, kv, ids: torch.Tensor, ctx: int) -> torch.Tensor:
    """ids [1, T], causal among themselves, after `ctx` committed positions (one request, slots = positions)."""
    T = ids.shape[1]
    pos = ctx + torch.arange(T)[None]  # [1, T]
    meta = AttentionMeta(positions=pos, write_slots=pos.clone(), block_table=torch.arange(KV_SLOTS // BLOCK)[None],
                         ctx_len=torch.tensor([ctx]), tree_mask=causal_mask(T)[None], block_size=BLOCK)
    return model(ids, meta, kv)  # [1, T, H]


# ---- compiled --------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(900)  # inductor compiles the steps: minutes on 2 cores shared with another worker (CI's -n 2)
def test_compiled_greedy_redrafter_equals_ar(tiny):
    """inductor (the CPU default) around the packed op this CPU's engines take (linear auto: AVX-512 where the CPU
    has it for the dtype, else oneDNN; each is checked eagerly above) and the CPU tree attention (an external op each;
    all KV blocks passed, so one static graph): ReDrafter with an oracle drafter (long and partial acceptances) ==
    compiled AR == eager AR. bf16 needs the step compiled with eager's roundings (graphs.Unit:
    emulate_precision_casts); without them the bf16 case fails (compiled tokens leave eager's, and on another tiny
    pair ReDrafter's left AR's)."""
    torch._dynamo.reset()  # another module's compiled engine: the step's graphs guard only on their arguments
    impl = _auto(DTYPES[tiny["dtype"]])
    ar = _need_ar(tiny, impl)
    engine = load_engine(tiny["engine_dir"], OracleProposer(tiny["engine_dir"], dict(enumerate(ar)), corrupt_every=2),
                         compile="inductor", linear=impl)
    # the CPU attention (test_cpu_attention.py's kernel) runs inside the graph; torch's without AVX-512
    assert engine.kernels == ("cpu" if cpu.available(DTYPES[tiny["dtype"]]) else "torch")
    res = generate(engine, tiny["prompts"], greedy(MAX_NEW), "redrafter")  # first: the oracle keys by request id
    assert [r.output_ids for r in res] == ar
    assert sum(r.accepted_draft_tokens for r in res) > 0
    assert [r.output_ids for r in generate(engine, tiny["prompts"], greedy(MAX_NEW), "ar")] == ar


def _prefetch_outputs() -> list[torch.Tensor]:
    """Float and weight-only layers (per channel, grouped, int4; fp32 and bf16 inputs) at 1, 5 and 17 rows."""
    outs = []
    for rows in (1, 5, 17):
        g = torch.Generator().manual_seed(rows)
        for dtype in (torch.float32, torch.bfloat16):
            if not cpu.available(dtype):
                continue
            x = torch.randn(rows, 576, generator=g).to(dtype)
            outs.append(lin.Linear(torch.randn(200, 576, generator=g).to(dtype), impl="avx512")(x))
            for bits, group_size in ((8, 576), (8, 64), (4, 64)):
                lo, hi = (-128, 127) if bits == 8 else (-8, 7)
                q = torch.randint(lo, hi + 1, (200, 576), generator=g, dtype=torch.int8)
                scales = (0.001 + 0.01 * torch.rand(200, 576 // group_size, generator=g)).to(dtype)
                outs.append(lin.Linear(lin.QuantWeight(q, scales, bits, group_size, dtype), impl="avx512")(x))
    return outs


def test_weight_prefetch_changes_no_bit():
    """The kernels prefetch each stream of weights ahead of its loads (cpu/linear.cpp, 1 KB by default). That only
    warms the cache: the float and weight-only layers give the same bits with no prefetch, the default, and a
    distance far past the end of every weight (a prefetch never faults)."""
    _need(torch.float32, "avx512")
    assert cpu.prefetch_bytes() == cpu.DEFAULT_PREFETCH_BYTES == cpu.loaded_prefetch_bytes()
    default = _prefetch_outputs()
    try:
        for ahead in (0, 1 << 20):
            assert cpu.set_prefetch_bytes(ahead) in (cpu.DEFAULT_PREFETCH_BYTES, 0)
            assert cpu.prefetch_bytes() == ahead
            assert all(torch.equal(a, b) for a, b in zip(_prefetch_outputs(), default, strict=True))
        with pytest.raises(RuntimeError, match="must be >= 0"):
            cpu.set_prefetch_bytes(-1)
    finally:
        cpu.set_prefetch_bytes(cpu.DEFAULT_PREFETCH_BYTES)


def test_weight_prefetch_distance_is_read_from_the_environment_at_load():
    """TRT_REDRAFTER_PREFETCH sets the distance when the kernels load (a process of its own: they load once)."""
    import os
    import subprocess
    import sys

    _need(torch.float32, "avx512")
    env = dict(os.environ, TRT_REDRAFTER_PREFETCH="0")
    out = subprocess.run([sys.executable, "-c", "from trt_redrafter import cpu; print(cpu.prefetch_bytes())"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "0"
