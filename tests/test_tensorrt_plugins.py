"""TensorRT plugin wrappers (trt_redrafter.plugins.tensorrt_plugins) against the PyTorch oracles.

On the CPU: each wrapper's shape function (what its TensorRT descriptor declares) and its launch code (what its
TensorRT impl callback runs) under Triton's interpreter, outputs equal to the oracle's, shapes and dtypes equal to
the oracle's outputs. With TensorRT >= 10.6 and a GPU: each plugin inside a real TensorRT network, built and run.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:  # must be set before the kernels are defined (triton.jit reads it)
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="the kernels need the triton package (pip install triton)")

from trt_redrafter.decoding import acceptance, beam_search, sampling, tree  # noqa: E402
from trt_redrafter.plugins.tensorrt_plugins import PACK_FIELDS, SPECS, TORCH_DTYPES  # noqa: E402

DEV = torch.device("cuda" if CUDA else "cpu")
HAVE_TENSORRT = importlib.util.find_spec("tensorrt") is not None


def _gen(seed):
    return torch.Generator(device=DEV).manual_seed(seed)


def _beams(bs, nb, bl, V, seed):
    b = torch.randint(0, V, (bs, nb, bl), generator=_gen(seed), device=DEV)
    b[:, :, 0] = 1
    return b


def _cases():
    """(plugin, inputs, attrs, oracle outputs in the plugin's output order)."""
    g = _gen(0)
    logits = torch.randn(4, 3, 200, generator=g, device=DEV) * 3
    score = torch.randn(4, 3, generator=g, device=DEV)
    out = []
    for warp in (50, 0):
        ref = beam_search.select_beams(logits, score, 3, warp or None)[:3]
        out.append(("beam_step", (logits, score), {"num_beams": 3, "warp_top_k": warp}, ref))
    beams = _beams(5, 4, 4, 3, 1)
    packed = tree.pack_beams(beams, pad_to=13)
    out.append(("pack_beams", (beams,), {"pad_to": 13}, [getattr(packed, f) for f in PACK_FIELDS]))
    node = torch.randint(0, 3, (5, 4, 4), generator=g, device=DEV)
    acc = acceptance.accept_tokens(beams, node)
    out.append(("accept_tokens", (beams, node), {}, [acc.beam_index, acc.num_accepted, acc.next_token]))
    probs = torch.softmax(torch.randn(9, 300, generator=g, device=DEV), -1)
    seed, pos = torch.arange(9, device=DEV) * 7, torch.arange(9, device=DEV) + 40
    out.append(("draw", (probs, seed, pos), {}, [sampling.draw(probs, seed, pos)]))
    return out


CASES = _cases()


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_wrapper_code_matches_the_oracle(case):
    name, inputs, attrs, ref = case
    spec = SPECS[name]
    got = spec(*inputs, **attrs)
    assert len(got) == len(ref) == len(spec.outputs)
    for out_name, g, r in zip(spec.outputs, got, ref):
        assert g.shape == r.shape and g.dtype == r.dtype, (out_name, g.shape, r.shape, g.dtype, r.dtype)
        if g.dtype == torch.float32:
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(g, r), out_name


@pytest.mark.parametrize("name", sorted(SPECS))
def test_declared_input_dtypes_are_checked(name):
    spec = SPECS[name]
    _, inputs, attrs, _ = next(c for c in CASES if c[0] == name)
    wrong = [t.to(torch.int32) for t in inputs]
    with pytest.raises(AssertionError, match=f"{name}: input {spec.inputs[0][0]} must be"):
        spec(*wrong, **attrs)
    assert set(dtype for _, dtype in spec.inputs) <= set(TORCH_DTYPES)


def test_without_tensorrt_registration_is_one_clear_error():
    if HAVE_TENSORRT:
        pytest.skip("tensorrt is installed here")
    from trt_redrafter.errors import UserError
    from trt_redrafter.plugins.tensorrt_plugins import register_tensorrt_plugins

    with pytest.raises(UserError, match=r"TensorRT >= 10\.6.*pip install"):
        register_tensorrt_plugins()


@pytest.mark.gpu
@pytest.mark.skipif(not (HAVE_TENSORRT and CUDA), reason="needs TensorRT >= 10.6 (tensorrt.plugin) and a CUDA GPU")
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_plugin_in_a_real_tensorrt_network_matches_the_oracle(case):
    import tensorrt as trt

    from trt_redrafter.plugins.tensorrt_plugins import add_plugin

    name, inputs, attrs, ref = case
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    dt = {torch.float32: trt.float32, torch.int64: trt.int64}
    ins = [network.add_input(f"in{i}", dt[t.dtype], tuple(t.shape)) for i, t in enumerate(inputs)]
    layer = add_plugin(network, name, *ins, **attrs)
    for i in range(layer.num_outputs):
        layer.get_output(i).name = f"out{i}"
        network.mark_output(layer.get_output(i))
    engine = trt.Runtime(logger).deserialize_cuda_engine(
        builder.build_serialized_network(network, builder.create_builder_config()))
    ctx = engine.create_execution_context()
    outs = [torch.empty_like(r) for r in ref]
    for i, t in enumerate(inputs):
        ctx.set_tensor_address(f"in{i}", t.contiguous().data_ptr())
    for i, o in enumerate(outs):
        ctx.set_tensor_address(f"out{i}", o.data_ptr())
    stream = torch.cuda.Stream()
    assert ctx.execute_async_v3(stream.cuda_stream)
    stream.synchronize()
    for o, r in zip(outs, ref):
        if o.dtype == torch.float32:
            torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(o, r)
