"""Weight-only quantized bases (int8 / int4, per channel or per group): the CPU kernel (`trt_redrafter_cpu::linear_wo`,
cpu/linear.cpp) against F.linear of the dequantized weight, a row's bits independent of the rows beside it, the op
under torch.compile, and `model.linear.Linear` over a `QuantWeight` in every implementation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trt_redrafter import cpu
from trt_redrafter.model import linear as lin

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
