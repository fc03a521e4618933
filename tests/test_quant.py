"""Quantized bases: weight-only int8 / int4 (per channel or per group) and FP8 (per tensor). The CPU kernel
(`trt_redrafter_cpu::linear_wo`, cpu/linear.cpp) against F.linear of the dequantized weight, a row's bits independent
of the rows beside it, the op under torch.compile, `model.linear.Linear` over a `QuantWeight` in every implementation;
FP8's quantize-dequantize and its fused layers; the checkpoints `convert --quantize` writes (TensorRT-LLM's W8A16 /
W4A16 / W4A16_AWQ / FP8), AWQ's search, FP8's calibration, the refusals; engines over them (greedy ReDrafter == the
quantized model's greedy AR, TP=2 == TP=1 under mpirun). FP8 through `torch._scaled_mm` is tests/test_gpu.py's."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from engine_utils import (OracleProposer, build_tiny_engines, decode_tp, greedy, load_engine, random_prompts,
                          run_cli)
from trt_redrafter import cpu
from trt_redrafter.checkpoint import quantization as qz
from trt_redrafter.errors import UserError
from trt_redrafter.fsutil import read_json
from trt_redrafter.model import linear as lin
from trt_redrafter.runtime.generate import generate
from trt_redrafter.runtime.sequence import RequestSpec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# (out, in, group size): SmolLM2's qkv per channel, its down-projection in groups of 64, a partial panel
SHAPES = [(960, 576, 576), (576, 1536, 64), (33, 64, 32)]


def _need_kernel() -> None:
    if not cpu.available(torch.float32):
        pytest.skip("this CPU has no AVX-512")
    cpu.ops()  # on such a CPU the kernel must build: a failure here is a failure


def _quant_weight(n: int, k: int, bits: int, group_size: int, dtype: torch.dtype, seed: int = 0) -> lin.QuantWeight:
    g = torch.Generator().manual_seed(seed)
    lo, hi = (-128, 127) if bits == 8 else (-8, 7)
    q = torch.randint(lo, hi + 1, (n, k), generator=g, dtype=torch.int8)
    scales = (0.001 + 0.01 * torch.rand(n, k // group_size, generator=g)).to(dtype)
    return lin.QuantWeight(q, scales, bits, group_size, dtype)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("shape", SHAPES)
def test_weight_only_kernel_matches_f_linear_of_the_dequantized_weight(bits, dtype, shape):
    _need_kernel()
    dt = DTYPES[dtype]
    n, k, gs = shape
    w = _quant_weight(n, k, bits, gs, dt)
    ref_w = w.q.double() * w.scales.double().repeat_interleave(gs, dim=1)
    bias = torch.randn(n).to(dt)
    layer = lin.Linear(w, bias, impl="avx512")
    assert layer.quant is not None and layer.packed.dtype == torch.uint8
    assert layer.packed.numel() == -(-n // 16) * 16 * k * bits // 8  # the bytes read: bits per weight
    for lead in [(1,), (5,), (2, 9)]:
        x = torch.randn(*lead, k).to(dt)
        y = layer(x)
        assert y.shape == (*lead, n) and y.dtype == dt
        ref = F.linear(x.double(), ref_w, bias.double())
        tol = dict(rtol=1e-5, atol=1e-4) if dt == torch.float32 else dict(rtol=1.6e-2, atol=2e-2)
        torch.testing.assert_close(y.double(), ref, **tol)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("shape", SHAPES)
def test_weight_only_rows_bits_do_not_depend_on_the_rows_beside_it(bits, dtype, shape):
    """What greedy ReDrafter == greedy (quantized) AR rests on: a token's outputs have the same bits in a one-row AR
    step and in a tree step of many rows, on 1 and 2 threads."""
    _need_kernel()
    dt = DTYPES[dtype]
    layer = lin.Linear(_quant_weight(shape[0], shape[1], bits, shape[2], dt), impl="avx512")
    X = torch.randn(40, shape[1]).to(dt)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            full = layer(X)
            assert [M for M in (1, 2, 3, 5, 7, 13, 17, 26) if not torch.equal(layer(X[:M]), full[:M])] == []
            assert [i for i in range(40) if not torch.equal(layer(X[i:i + 1])[0], full[i])] == []
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group_size", [64, 96])
def test_bf16_inputs_run_k_pairs_where_the_cpu_has_avx512_bf16(bits, group_size):
    """bf16 inputs on an AVX512-BF16 CPU take VDPBF16PS over k pairs (`wo_pairs`, named in the layer's path); fp32
    inputs, an odd group size (int8) and CPUs without it widen to fp32 FMAs. Either way the layer is F.linear of the
    dequantized weight and a row's bits do not depend on the rows beside it."""
    _need_kernel()
    pairs = cpu.available(torch.bfloat16)
    assert cpu.wo_pairs(torch.bfloat16, group_size) == pairs
    assert not cpu.wo_pairs(torch.float32, group_size) and not cpu.wo_pairs(torch.bfloat16, 65)
    w = _quant_weight(80, 192, bits, group_size, torch.bfloat16, 5)
    layer = lin.Linear(w, impl="avx512")
    assert layer.quant_pairs == pairs and ("VDPBF16PS" in layer.path) == pairs
    assert not lin.Linear(_quant_weight(80, 192, bits, group_size, torch.float32, 5), impl="avx512").quant_pairs
    X = torch.randn(30, 192).bfloat16()
    full = layer(X)
    ref = F.linear(X.double(), w.q.double() * w.scales.double().repeat_interleave(group_size, dim=1))
    torch.testing.assert_close(full.double(), ref, rtol=1.6e-2, atol=2e-2)
    assert [M for M in (1, 2, 5, 9, 17) if not torch.equal(layer(X[:M]), full[:M])] == []
    assert [i for i in range(30) if not torch.equal(layer(X[i:i + 1])[0], full[i])] == []


def test_bf16_inputs_with_an_odd_group_size_widen_to_fp32():
    """int8 per channel over an odd K: no k pairs, the FMA path, still F.linear of q s and row-invariant."""
    _need_kernel()
    w = _quant_weight(40, 65, 8, 65, torch.bfloat16, 6)
    layer = lin.Linear(w, impl="avx512")
    assert not layer.quant_pairs and "VDPBF16PS" not in layer.path
    X = torch.randn(12, 65).bfloat16()
    full = layer(X)
    torch.testing.assert_close(full.double(), F.linear(X.double(), w.q.double() * w.scales.double()),
                               rtol=1.6e-2, atol=2e-2)
    assert [M for M in (1, 2, 5, 7) if not torch.equal(layer(X[:M]), full[:M])] == []


@pytest.mark.parametrize("impl", ["torch", "onednn"])
def test_other_impls_run_the_dequantized_weight(impl):
    """Where the weight-only kernel does not run, the layer computes with q * s in the model dtype: the same
    quantized model."""
    if impl == "onednn" and not lin.onednn_available(torch.float32):
        pytest.skip("no native oneDNN float32 GEMM")
    w = _quant_weight(64, 96, 8, 32, torch.float32)
    layer = lin.Linear(w, impl=impl)
    x = torch.randn(3, 96)
    torch.testing.assert_close(layer(x), F.linear(x, w.dequantize()), rtol=1e-5, atol=1e-5)
    assert layer.quant is None


def test_quant_weight_cat_stacks_output_channels():
    a, b = _quant_weight(16, 64, 4, 32, torch.float32, 1), _quant_weight(8, 64, 4, 32, torch.float32, 2)
    both = lin.QuantWeight.cat([a, b])
    assert torch.equal(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))


@pytest.mark.slow
@pytest.mark.parametrize("bits", [8, 4])
def test_compiled_weight_only_op_equals_eager(bits):
    """Dynamo traces `trt_redrafter_cpu::linear_wo` (its fake function gives the shape) with a dynamic row count;
    inductor calls it as an external kernel: the same bits as eager."""
    _need_kernel()
    torch._dynamo.reset()
    up = lin.Linear(_quant_weight(256, 64, bits, 64, torch.bfloat16, 3), impl="avx512")
    down = lin.Linear(_quant_weight(64, 256, bits, 32, torch.bfloat16, 4), torch.randn(64).bfloat16(), impl="avx512")

    def mlp(x):
        return down(F.silu(up(x))) + x

    compiled = torch.compile(mlp, fullgraph=True)
    with torch.inference_mode():
        for M in (1, 3, 17):
            x = torch.randn(M, 64).bfloat16()
            if M > 1:
                torch._dynamo.mark_dynamic(x, 0)
            assert torch.equal(compiled(x), mlp(x)), M


# ---- checkpoints and engines -------------------------------------------------------------------------------------

MAX_NEW = 20
PROMPT_LENS = [5, 11, 3, 8]


def test_quantizer_is_tensorrt_llms_symmetric_quantize():
    """cutlass_preprocessors.cpp `symmetric_quantize`: scale = amax / 128 (int8) or / 8 (int4) per output channel,
    q = round half away from zero, clamped to [-128, 127] / [-8, 7]; a zero row gets scale 0 and q 0; the stored
    scale is rounded to the model dtype, q computed with the fp32 one."""
    w = torch.tensor([[1.0, -0.5, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0], [-2.0, 1.0, 0.75, -0.1]])
    q8, s8 = qz.quantize_per_channel(w, 8, torch.float32)
    assert s8[:, 0].tolist() == [1 / 128, 0.0, 2 / 128]
    assert q8.tolist() == [[127, -64, 32, 0], [0, 0, 0, 0], [-128, 64, 48, -6]]  # 128 clamps; -6.4 -> -6
    q4, s4 = qz.quantize_per_channel(w, 4, torch.bfloat16)
    assert s4.dtype == torch.bfloat16 and s4[:, 0].float().tolist() == [1 / 8, 0.0, 2 / 8]
    assert q4.tolist() == [[7, -4, 2, 0], [0, 0, 0, 0], [-8, 4, 3, 0]]  # 0.25 * 8 = 2; 0.75 / 0.25 = 3; -0.4 -> 0
    half = torch.tensor([[2.5, -2.5, 8.0]])  # amax 8 -> int4 scale 1: 2.5 rounds away from zero, to 3 and -3
    assert qz.quantize_per_channel(half, 4, torch.float32)[0].tolist() == [[3, -3, 7]]


def test_quantized_checkpoint_config_keeps_the_drafter_float(tmp_path):
    """`convert --quantize int8_wo` writes quantize.py's form: quant_algo W8A16, float weights, an explicit
    exclude_modules (TensorRT-LLM's default list) to which the ReDrafter converter's drafter names are added."""
    run_cli("make-tiny", "--output", tmp_path / "tiny", "--seed", 3)
    run_cli("convert", "--base-model", tmp_path / "tiny" / "base", "--drafter", tmp_path / "tiny" / "drafter",
            "--output", tmp_path / "ckpt", "--dtype", "float32", "--quantize", "int8_wo")
    q = read_json(tmp_path / "ckpt" / "config.json", "")["quantization"]
    assert q["quant_algo"] == "W8A16"
    assert q["exclude_modules"][:len(qz.DEFAULT_EXCLUDE)] == qz.DEFAULT_EXCLUDE
    assert {"drafter", "drafter.lm_head", "drafter.layers.0.linear"} <= set(q["exclude_modules"])
    mode = qz.parse_quantization({"quantization": q}, "")
    assert mode.bits == 8 and not mode.quantizes("lm_head") and not mode.quantizes("drafter.layers.0.linear")
    assert mode.quantizes("transformer.layers.0.mlp.proj")
    from safetensors.torch import load_file
    assert all(t.dtype == torch.float32 for t in load_file(str(tmp_path / "ckpt" / "rank0.safetensors")).values())


def test_quantized_checkpoint_refusals(tmp_path):
    sq = qz.parse_quantization({"quantization": {"quant_algo": "W8A8_SQ_PER_CHANNEL"}}, "cfg")
    assert sq.algo == "W8A8_SQ_PER_CHANNEL" and sq.bits == 0  # read (the trtllm backend builds it), not run here
    with pytest.raises(UserError, match="quant_algo 'W8A8_SQ_PER_CHANNEL' is not one the torch backend runs"):
        qz.require_torch_runs(sq, "cfg")
    fp8 = qz.parse_quantization({"quantization": {"quant_algo": "FP8", "exclude_modules": ["lm_head"]}}, "cfg")
    qz.require_torch_runs(fp8, "cfg")
    assert fp8.fp8 and fp8.stored_quantized and not fp8.quantizes("lm_head")
    kv = qz.parse_quantization({"quantization": {"quant_algo": None, "kv_cache_quant_algo": "FP8"}}, "cfg")
    with pytest.raises(UserError, match="kv_cache_quant_algo 'FP8'"):
        qz.require_torch_runs(kv, "cfg")
    assert not kv.quantizes("transformer.layers.0.mlp.proj")
    tensors = {"transformer.layers.0.mlp.proj.weight": torch.zeros(4, 8, dtype=torch.int8)}
    with pytest.raises(UserError, match="CUTLASS's mixed-GEMM layout"):
        qz.refuse_preprocessed(tensors, "transformer.layers.0.mlp.proj.weight", "engine weights")
    with pytest.raises(SystemExit):  # argparse: not a choice
        run_cli("convert", "--base-model", tmp_path, "--drafter", tmp_path, "--output", tmp_path / "x",
                "--quantize", "int2")


def _calib_file(path):
    path.write_text("\n".join(json.dumps({"prompt": f"calibration prompt number {i} about weights"})
                              for i in range(8)))
    return path


@pytest.fixture(scope="module", params=["int8_wo", "int4_wo", "int4_awq", "fp8"])
def quantized(request, tmp_path_factory):
    _need_kernel()
    root = tmp_path_factory.mktemp(request.param)
    _, engines = build_tiny_engines(root, seed=17, num_beams=4, draft_len=3, kv_block_size=16, num_heads=4,
                                    num_kv_heads=2, intermediate_size=256,
                                    convert_args=("--quantize", request.param, "--quantize-lm-head",
                                                  "--group-size", "64", "--calib-prompts",
                                                  _calib_file(root / "calib.jsonl")))
    _, plain = build_tiny_engines(root / "plain", seed=17, num_beams=4, draft_len=3, kv_block_size=16, num_heads=4,
                                  num_kv_heads=2, intermediate_size=256)
    prompts = random_prompts(384, PROMPT_LENS, seed=17)
    return dict(mode=request.param, engine=engines[1], plain=plain[1], prompts=prompts)


def test_quantized_engine_runs_its_linear_layers_in_the_weight_only_kernel(quantized):
    """Weight-only: the base's layers in linear_wo at their bits and group size. FP8 on the CPU: each base layer
    quantizes its input to e4m3 with its own scale, over the dequantized weight in the float kernel. The drafter
    stays float either way."""
    engine = load_engine(quantized["engine"], linear="avx512")
    layer = engine.model.layers[0]
    base = (layer.attn.qkv, layer.attn.dense, layer.mlp.fc_gate, layer.mlp.proj, engine.model.lm_head)
    if quantized["mode"] == "fp8":
        assert all(m.input_scale is not None and m.fp8 is None and m.quant is None and m.packed is not None
                   for m in base)
    else:
        bits = 8 if quantized["mode"] == "int8_wo" else 4
        for lin_layer in base:
            assert lin_layer.quant is not None and lin_layer.quant[1] == bits, lin_layer
            assert lin_layer.quant[2] == (64 if quantized["mode"] == "int4_awq" else lin_layer.in_features)
    assert all(m.quant is None and m.input_scale is None
               for m in engine.drafter.modules() if isinstance(m, lin.Linear))  # drafter float


@pytest.mark.parametrize("corrupt_every", [None, 0, 2])
def test_greedy_redrafter_equals_quantized_ar(quantized, corrupt_every):
    """Verification runs on the quantized base itself: ReDrafter's tokens are the quantized model's AR tokens, with
    the engine's drafter (None) and an oracle forcing long (0) and partial (2) acceptances."""
    engine = load_engine(quantized["engine"], linear="avx512")
    ar = [r.output_ids for r in generate(engine, quantized["prompts"], greedy(MAX_NEW), "ar")]
    proposer = None if corrupt_every is None else \
        OracleProposer(quantized["engine"], dict(enumerate(ar)), corrupt_every=corrupt_every)
    engine = load_engine(quantized["engine"], proposer, linear="avx512")
    res = generate(engine, quantized["prompts"], greedy(MAX_NEW), mode="redrafter")
    assert [r.output_ids for r in res] == ar
    if corrupt_every == 0:
        assert min(r.tokens_per_step for r in res) > 1.5


@pytest.mark.slow
def test_bf16_weight_only_engine_greedy_redrafter_equals_its_ar(tmp_path):
    """A bf16 engine over int8 weights: its layers run k pairs where the CPU has AVX512-BF16 (VDPBF16PS, one
    instruction for every row count), and greedy ReDrafter still gives its AR tokens, with the engine's drafter and
    with an oracle whose long drafts are accepted."""
    _need_kernel()
    _, engines = build_tiny_engines(tmp_path, seed=17, num_beams=4, draft_len=3, kv_block_size=16, num_heads=4,
                                    num_kv_heads=2, intermediate_size=256, dtype="bfloat16",
                                    convert_args=("--quantize", "int8_wo", "--quantize-lm-head"))
    prompts = random_prompts(384, PROMPT_LENS, seed=17)
    engine = load_engine(engines[1], linear="avx512")
    paths = set(lin.linear_paths(engine.model, None))
    assert paths == {"avx512 int8 weights" + (", bf16 pairs (VDPBF16PS)" if cpu.available(torch.bfloat16) else "")}
    ar = [r.output_ids for r in generate(engine, prompts, greedy(MAX_NEW), "ar")]
    for corrupt_every in (None, 0):
        proposer = None if corrupt_every is None else \
            OracleProposer(engines[1], dict(enumerate(ar)), corrupt_every=corrupt_every)
        res = generate(load_engine(engines[1], proposer, linear="avx512"), prompts, greedy(MAX_NEW), "redrafter")
        assert [r.output_ids for r in res] == ar
        assert sum(r.accepted_draft_tokens for r in res) > 0
        if corrupt_every == 0:
            assert min(r.tokens_per_step for r in res) > 1.5  # the oracle's drafts: several tokens a step


def test_quantized_engine_is_the_dequantized_model(quantized):
    """The kernel's engine and the same engine on F.linear over q * s (impl torch) compute one model: their prompt
    logits agree to fp32 rounding; the float model's differ from them by more (the quantization is really applied)."""
    logits = {name: _prompt_logits(path, impl, quantized["prompts"][1])
              for name, path, impl in (("kernel", quantized["engine"], "avx512"),
                                       ("dequant", quantized["engine"], "torch"), ("float", quantized["plain"], "torch"))}
    torch.testing.assert_close(logits["kernel"], logits["dequant"], rtol=1e-4, atol=1e-4)
    assert (logits["float"] - logits["dequant"]).abs().max() > 10 * (logits["kernel"] - logits["dequant"]).abs().max()


def _prompt_logits(path, impl: str, prompt: list[int]) -> torch.Tensor:
    engine = load_engine(path, linear=impl)
    captured = {}
    orig = engine.model.logits

    def spy(hidden):
        out = orig(hidden)
        captured["logits"] = out.reshape(-1, out.shape[-1]).float().clone()
        return out

    engine.model.logits = spy
    engine.step([engine.new_sequence(RequestSpec(prompt, greedy(2)))])
    return captured["logits"]


def test_a_row_parallel_slice_quantized_with_the_rows_amax_is_the_slice_of_the_whole():
    """What makes the quantized model independent of TP: a rank quantizing its half of each row with the row's amax
    (all ranks', `Dist.all_reduce_max` at load) gets exactly its half of the TP=1 quantization; with its own
    amax it would not."""
    w = torch.randn(32, 64)
    w[:, :32] *= 4  # the first rank's half holds the larger values
    q, s = qz.quantize_per_channel(w, 4, torch.float32)
    half = w[:, 32:]
    q2, s2 = qz.quantize_per_channel(half, 4, torch.float32, qz.channel_amax(w))
    assert torch.equal(q2, q[:, 32:]) and torch.equal(s2, s)
    assert not torch.equal(qz.quantize_per_channel(half, 4, torch.float32)[0], q[:, 32:])


@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI's mpirun is not installed")
@pytest.mark.parametrize("mode", ["int4_wo", "fp8"])
def test_tp2_quantized_engine_gives_the_tp1_tokens(tmp_path, mode):
    """int4 per channel, where a rank's own amax would change the model most, and FP8, whose per-tensor scales every
    rank shares: TP=2 (real mpirun ranks) gives the TP=1 tokens, AR and ReDrafter."""
    pytest.importorskip("mpi4py", reason="mpi4py is not installed")
    _need_kernel()
    _, engines = build_tiny_engines(tmp_path, seed=23, num_beams=4, draft_len=3, tps=(1, 2), num_heads=4,
                                    num_kv_heads=2, vocab_size=512,
                                    convert_args=("--quantize", mode, "--calib-prompts",
                                                  _calib_file(tmp_path / "calib.jsonl")))
    prompts = random_prompts(512, [4, 9, 6], seed=3)
    runs = {"ar": {"prompts": prompts, "mode": "ar"}, "redrafter": {"prompts": prompts}}
    ref, tp2 = decode_tp(engines[1], runs, 1, tmp_path), decode_tp(engines[2], runs, 2, tmp_path)
    for mode in runs:
        assert tp2[mode]["output_ids"] == ref[mode]["output_ids"], mode
    assert ref["redrafter"]["output_ids"] == ref["ar"]["output_ids"]
    assert all(n > 0 for n in tp2["redrafter"]["draft_tokens"])  # trees were drafted and verified on both ranks


def test_int4_rows_pack_two_output_channels_per_byte_and_unpack():
    """ModelOpt's `pack_int4_in_uint8` layout: output rows 2j (low nibble) and 2j + 1 (high nibble), two's complement."""
    q = torch.arange(-8, 8, dtype=torch.int8).repeat(4, 1).T.contiguous()  # [16, 4]: rows -8 .. 7
    packed = qz.pack_int4_rows(q)
    assert packed.shape == (8, 4) and packed.dtype == torch.int8
    assert packed[0, 0].item() == ((-7 & 0xF) << 4 | (-8 & 0xF)) - 256  # rows 0 (-8) and 1 (-7)
    assert torch.equal(qz.unpack_int4_rows(packed), q)


def test_awq_checkpoint_stores_tensorrt_llms_w4a16_awq_layout(tmp_path):
    run_cli("make-tiny", "--output", tmp_path / "tiny", "--seed", 4, "--intermediate-size", 256)
    run_cli("convert", "--base-model", tmp_path / "tiny" / "base", "--drafter", tmp_path / "tiny" / "drafter",
            "--output", tmp_path / "ckpt", "--dtype", "bfloat16", "--quantize", "int4_awq", "--group-size", "64")
    run_cli("convert", "--base-model", tmp_path / "tiny" / "base", "--drafter", tmp_path / "tiny" / "drafter",
            "--output", tmp_path / "float", "--dtype", "bfloat16")
    cfg = read_json(tmp_path / "ckpt" / "config.json", "")["quantization"]
    assert (cfg["quant_algo"], cfg["group_size"], cfg["pre_quant_scale"], cfg["has_zero_point"]) == \
        ("W4A16_AWQ", 64, True, False)
    from safetensors.torch import load_file
    t, f = load_file(str(tmp_path / "ckpt" / "rank0.safetensors")), load_file(str(tmp_path / "float" / "rank0.safetensors"))
    name = "transformer.layers.0.mlp.proj"
    w = f[name + ".weight"]
    out, k = w.shape
    assert t[name + ".weight"].dtype == torch.int8 and t[name + ".weight"].shape == (out // 2, k)
    assert t[name + ".weights_scaling_factor"].shape == (out, k // 64)
    assert t[name + ".prequant_scaling_factor"].shape == (k,) and t[name + ".prequant_scaling_factor"].dtype == torch.bfloat16
    q = qz.unpack_int4_rows(t[name + ".weight"]).float()
    s = t[name + ".weights_scaling_factor"].float().repeat_interleave(64, dim=1)
    assert ((q * s - w.float()).abs() <= s / 2 + 1e-6).all()  # round to nearest within each group
    assert q.abs().amax(dim=1).max() == 7 and "transformer.layers.0.input_layernorm.weight" in t  # norms stay float
    assert t["lm_head.weight"].dtype == torch.bfloat16 and t["drafter.lm_head.weight"].dtype == torch.bfloat16


def test_awq_pre_quant_scale_multiplies_the_input():
    _need_kernel()
    w = _quant_weight(32, 128, 4, 64, torch.float32, 5)
    w.pre_scale = 0.5 + torch.rand(128)
    x = torch.randn(3, 128)
    ref = F.linear(x * w.pre_scale, w.dequantize())
    for impl in ("avx512", "torch"):
        torch.testing.assert_close(lin.Linear(w, impl=impl)(x), ref, rtol=1e-5, atol=1e-5)
    other = _quant_weight(16, 128, 4, 64, torch.float32, 6)
    with pytest.raises(UserError, match="different AWQ pre-quant scales"):
        lin.QuantWeight.cat([w, other])


def test_awq_search_beats_round_to_nearest_where_inputs_have_outlier_channels():
    """AWQ's point: with a few input channels much larger than the rest, scaling them up before quantizing (and the
    input down by as much) loses less than plain round-to-nearest (alpha 0, s = 1), which the search also tries."""
    from trt_redrafter.checkpoint.awq import _dequant, best_scale
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 128, generator=g)
    x[:, :4] *= 30  # outlier channels
    ws = [torch.randn(64, 128, generator=g), torch.randn(32, 128, generator=g)]
    s, alpha = best_scale(x, ws, 64)
    assert alpha > 0 and s.shape == (128,)

    def err(scale):
        return sum(float(((x / scale) @ _dequant(w * scale, 64).T - x @ w.T).pow(2).sum()) for w in ws)

    assert err(s) < 0.9 * err(torch.ones(128))
    t = qz.awq_tensors(ws[0], 64, torch.float32, s)
    pre = t["prequant_scaling_factor"]
    assert torch.allclose(pre, 1 / s) and t["weight"].shape == (32, 128)
    q = qz.unpack_int4_rows(t["weight"]).float() * t["weights_scaling_factor"].repeat_interleave(64, dim=1)
    assert float(((x * pre) @ q.T - x @ ws[0].T).pow(2).sum()) < float(((x @ _dequant(ws[0], 64).T) - x @ ws[0].T).pow(2).sum())


def test_awq_row_parallel_scales_are_sliced_per_rank():
    """A row-parallel layer's ranks hold halves of its inputs: each gets its half of s, so TP=2 stores exactly the
    TP=1 layer split on dim 1 (groups never straddle ranks)."""
    quant = qz.Quantization("W4A16_AWQ", 4, (), 64)
    w, s = torch.randn(8, 256), 0.5 + torch.rand(256)
    name = "transformer.layers.0.mlp.proj"
    full = qz.store_quantized({name + ".weight": w}, quant, 1, torch.float32, {name: {"smooth": s}})
    for rank in (0, 1):
        half = qz.store_quantized({name + ".weight": w.chunk(2, dim=1)[rank]}, quant, 1, torch.float32,
                                  {name: {"smooth": s}}, tp_size=2, rank=rank)
        for key, dim in (("weight", 1), ("weights_scaling_factor", 1), ("prequant_scaling_factor", 0)):
            assert torch.equal(half[f"{name}.{key}"], full[f"{name}.{key}"].chunk(2, dim=dim)[rank]), key


def test_awq_calibration_prompts_from_a_file_reach_the_search(tmp_path):
    run_cli("make-tiny", "--output", tmp_path / "tiny", "--seed", 4, "--intermediate-size", 256)
    calib = tmp_path / "calib.jsonl"
    calib.write_text("\n".join(json.dumps({"prompt": f"calibration prompt number {i} about weights"}) for i in range(8)))
    common = ("--base-model", tmp_path / "tiny" / "base", "--drafter", tmp_path / "tiny" / "drafter", "--dtype",
              "float32", "--quantize", "int4_awq", "--group-size", "64")
    run_cli("convert", *common, "--output", tmp_path / "awq", "--calib-prompts", calib)
    run_cli("convert", *common, "--output", tmp_path / "rtn", "--calib-prompts", "none")
    from safetensors.torch import load_file
    awq, rtn = (load_file(str(tmp_path / d / "rank0.safetensors")) for d in ("awq", "rtn"))
    pre = [k for k in awq if k.endswith("prequant_scaling_factor")]
    assert pre and all(bool((rtn[k] == 1).all()) for k in pre)
    assert any(not bool((awq[k] == 1).all()) for k in pre)  # the search chose scales
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "no known key"}))
    from trt_redrafter.checkpoint.convert import ConvertConfig
    from trt_redrafter.commands.convert import calibration_ids
    with pytest.raises(UserError, match=r"bad.jsonl:1: expected \{\"prompt\": str\} \(or \"text\"\), MT-Bench"):
        calibration_ids(ConvertConfig(quantize="int4_awq", calib_prompts=str(bad)), tmp_path / "tiny" / "base")


def test_trtllm_build_refuses_a_quantized_lm_head_before_importing_tensorrt_llm(tmp_path):
    from trt_redrafter.backends.torch_build import check_checkpoint
    from trt_redrafter.backends.trtllm import check_buildable
    from trt_redrafter.config import BuildConfig
    run_cli("make-tiny", "--output", tmp_path / "tiny", "--seed", 3, "--num-heads", 2)  # head size 32: buildable
    for lm_head in (False, True):
        ckpt = tmp_path / f"ckpt-{lm_head}"
        run_cli("convert", "--base-model", tmp_path / "tiny" / "base", "--drafter", tmp_path / "tiny" / "drafter",
                "--output", ckpt, "--quantize", "int8_wo", *(["--quantize-lm-head"] if lm_head else []))
        info = check_checkpoint(ckpt, None)
        if lm_head:
            with pytest.raises(UserError, match="lm_head is quantized"):
                check_buildable(info, BuildConfig(), ckpt)
        else:
            check_buildable(info, BuildConfig(), ckpt)


def test_a_group_size_that_does_not_divide_is_refused_before_calibrating(tmp_path):
    """make-tiny's hidden size 64 holds no group of 128: refused with the sizes that fit, before AWQ's calibration
    prompts are made (they take a while on a real base) and before anything is written."""
    from trt_redrafter.checkpoint.convert import ConvertConfig, convert_checkpoint
    from trt_redrafter.config import ReDrafterConfig
    run_cli("make-tiny", "--output", tmp_path / "tiny", "--seed", 3, "--intermediate-size", 256)

    def calibrate():
        raise AssertionError("calibration ran before the group size was checked")

    with pytest.raises(UserError, match=r"--group-size 128 does not divide hidden_size = 64 .* use --group-size 64"):
        convert_checkpoint(tmp_path / "tiny" / "drafter", tmp_path / "out", ConvertConfig(quantize="int4_awq"),
                           ReDrafterConfig(), base_model=tmp_path / "tiny" / "base", calibrate=calibrate)
    assert not (tmp_path / "out").exists()


# ---- FP8 --------------------------------------------------------------------------------------------------------

def test_fp8_tensors_round_trip_within_e4m3s_error():
    """fp8_tensors writes ModelOpt's export (scale = amax / 448, fp32 [1]; weight = w / scale in e4m3) and read_fp8
    reads it back: every weight within e4m3's half-ulp (2^-4 relative, or the subnormal step near zero)."""
    w = torch.randn(48, 64) * 0.05
    t = qz.fp8_tensors(w, float(w.abs().max()), 3.0)
    assert t["weight"].dtype == torch.float8_e4m3fn and t["weight"].shape == w.shape
    for key, value in (("weights_scaling_factor", float(w.abs().max()) / 448), ("activation_scaling_factor", 3 / 448)):
        assert t[key].dtype == torch.float32 and tuple(t[key].shape) == (1,)
        assert t[key].item() == pytest.approx(value, rel=1e-6)
    name = "transformer.layers.0.mlp.proj"
    w8, ws, xs = qz.read_fp8({f"{name}.{k}": v for k, v in t.items()}, name, "test")
    back = lin.Fp8Weight(w8, ws, xs, torch.float32).dequantize()
    assert (back - w).abs().le(w.abs() / 16 + ws * 2 ** -9).all()
    assert float(back.abs().max()) == pytest.approx(float(w.abs().max()), rel=1e-6)  # amax maps onto 448 exactly
    with pytest.raises(UserError, match="lacks transformer.layers.0.mlp.proj.activation_scaling_factor"):
        qz.read_fp8({f"{name}.weight": t["weight"], f"{name}.weights_scaling_factor": ws}, name, "test")
    with pytest.raises(UserError, match="has 64 values; FP8 \\(per tensor\\) has one"):
        qz.read_fp8({f"{name}.weight": t["weight"], f"{name}.weights_scaling_factor": ws,
                     f"{name}.activation_scaling_factor": torch.ones(64)}, name, "test")


def test_fp8_input_quantize_dequantize_rounds_to_e4m3_and_saturates():
    s = torch.tensor(0.5)
    x = torch.tensor([[0.5 * 1.0, 0.5 * 1.125, 0.5 * 1.0625, 0.5 * 448, 0.5 * 1000, -0.5 * 1000]])
    # 1 and 1.125 are e4m3 values (3 mantissa bits), 1.0625 lies halfway and rounds to even (1), beyond 448 saturates
    assert lin.fp8_qdq(x, s).tolist() == [[0.5, 0.5625, 0.5, 224.0, 224.0, -224.0]]
    assert lin.fp8_qdq(x.bfloat16(), s).dtype == torch.bfloat16


def test_fp8_fused_layers_take_the_larger_scale_as_tensorrt_llms_fuse_gate_mlp():
    """mlp.fc and mlp.gate keep their own scales in the checkpoint; fused into one matmul they are requantized to the
    larger weight scale and read the input with the larger input scale (models/modeling_utils.py fuse_gate_mlp)."""
    a = lin.Fp8Weight(torch.randn(8, 16).to(torch.float8_e4m3fn), torch.tensor(0.01), torch.tensor(0.02),
                      torch.float32)
    b = lin.Fp8Weight(torch.randn(8, 16).to(torch.float8_e4m3fn), torch.tensor(0.04), torch.tensor(0.03),
                      torch.float32)
    fused = lin.Fp8Weight.cat([a, b])
    assert fused.scale.item() == pytest.approx(0.04) and fused.input_scale.item() == pytest.approx(0.03)
    assert torch.equal(fused.w8[8:].float(), b.w8.float())  # the part already at the larger scale is unchanged
    expect = (a.w8.float() * 0.01 / 0.04).to(torch.float8_e4m3fn).float()
    assert torch.equal(fused.w8[:8].float(), expect)
    same = lin.Fp8Weight.cat([a, lin.Fp8Weight(b.w8, a.scale, a.input_scale, torch.float32)])
    assert torch.equal(same.w8.float(), torch.cat([a.w8.float(), b.w8.float()]))  # equal scales: exact


def test_fp8_checkpoint_stores_modelopts_layout_with_calibrated_scales(tmp_path):
    """`convert --quantize fp8`: quant_algo FP8, each base layer e4m3 with fp32 [1] weight and activation scales;
    q, k and v share one weight scale (the max of theirs); the input scales are the calibration inputs' amax / 448,
    the same for layers reading one input; the drafter, the embedding and (by default) lm_head stay float. Without
    calibration prompts it is refused."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    run_cli("make-tiny", "--output", tmp_path / "tiny", "--seed", 4, "--intermediate-size", 256)
    base = tmp_path / "tiny" / "base"
    common = ("--base-model", base, "--drafter", tmp_path / "tiny" / "drafter", "--dtype", "float32", "--quantize",
              "fp8")
    calib = _calib_file(tmp_path / "calib.jsonl")
    run_cli("convert", *common, "--output", tmp_path / "fp8", "--calib-prompts", calib)
    assert read_json(tmp_path / "fp8" / "config.json", "")["quantization"]["quant_algo"] == "FP8"
    t = load_file(str(tmp_path / "fp8" / "rank0.safetensors"))
    hf = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(base))
    inputs = {}
    hook = hf.model.layers[1].mlp.down_proj.register_forward_pre_hook(
        lambda _m, a: inputs.update(amax=max(inputs.get("amax", 0.0), float(a[0].abs().max()))))
    with torch.inference_mode():
        for row in calib.read_text().splitlines():
            hf(torch.tensor([tok(json.loads(row)["prompt"])["input_ids"]]))
    hook.remove()
    p = "transformer.layers.1."
    assert t[p + "mlp.proj.activation_scaling_factor"].item() == pytest.approx(inputs["amax"] / 448, rel=1e-5)
    assert t[p + "mlp.fc.activation_scaling_factor"].item() == t[p + "mlp.gate.activation_scaling_factor"].item()
    attn = hf.model.layers[1].self_attn
    qkv_amax = max(float(m.weight.detach().abs().max()) for m in (attn.q_proj, attn.k_proj, attn.v_proj))
    assert t[p + "attention.qkv.weights_scaling_factor"].item() == pytest.approx(qkv_amax / 448, rel=1e-6)
    qkv = t[p + "attention.qkv.weight"].float() * t[p + "attention.qkv.weights_scaling_factor"]
    ref = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach()
    assert (qkv - ref).abs().le(ref.abs() / 16 + qkv_amax / 448 * 2 ** -9).all()
    for name in ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj"):
        assert t[f"{p}{name}.weight"].dtype == torch.float8_e4m3fn
        assert tuple(t[f"{p}{name}.weights_scaling_factor"].shape) == (1,)
    floats = ("drafter", "lm_head", "transformer.vocab")
    assert all(v.dtype == torch.float32 for k, v in t.items() if k.startswith(floats))
    from trt_redrafter.checkpoint.convert import ConvertConfig, convert_checkpoint
    from trt_redrafter.commands.convert import calibration_ids
    from trt_redrafter.config import ReDrafterConfig
    with pytest.raises(UserError, match="none: fp8 needs calibration prompts"):
        ConvertConfig(quantize="fp8", calib_prompts="none").validate()
    opts = ConvertConfig(quantize="fp8", dtype="float32")
    with pytest.raises(UserError, match="--quantize fp8 needs calibration prompts"):  # make-tiny has no chat template
        convert_checkpoint(tmp_path / "tiny" / "drafter", tmp_path / "none", opts, ReDrafterConfig(), base_model=base,
                           calibrate=lambda: calibration_ids(opts, base))
    assert not (tmp_path / "none").exists()
