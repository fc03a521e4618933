"""TensorRT plugin wrappers of the decode-step kernels (TensorRT's Python plugin API, `tensorrt.plugin`).

Four kernels have a fixed tensor contract that fits a TensorRT layer: `beam_step`, `pack_beams`, `accept_tokens` and
`draw` (namespace `trt_redrafter`, e.g. `trt_redrafter::beam_step`). `tree_attention` and the KV rewind are not
wrapped: inside a TensorRT-LLM engine the paged KV cache belongs to TensorRT-LLM's attention plugin and its runtime.

Each wrapper is a `PluginSpec`: the output shapes as a function of the input shapes and attributes (written with
indexing and integer arithmetic only, so the same function runs on ints here and on TensorRT's symbolic
`ShapeExpr`s in the plugin's descriptor) and `launch`, which runs the kernel on torch tensors and writes the
outputs in place. The TensorRT `impl` callbacks call `launch` on zero-copy views of TensorRT's buffers, so the code
TensorRT runs is the code tests/test_tensorrt_plugins.py checks against the PyTorch oracles (on the CPU under
Triton's interpreter; with TensorRT on a GPU inside a real network).

API followed (NVIDIA/TensorRT, python/packages/tensorrt/plugin at tag v10.11, 9255eb39; `register`/`impl` exist since
10.6): `@trtp.register("ns::name")` on a descriptor `(inputs: trtp.TensorDesc, attrs) -> TensorDesc | tuple`,
`@trtp.impl("ns::name")` on `(inputs: trtp.Tensor, attrs, outputs: Tuple[trtp.Tensor], stream: int) -> None`,
`trtp.from_shape_expr(shape, dtype)`, `network.add_plugin(trtp.op.ns.name(*inputs, **attrs))`
(samples/python/quickly_deployable_plugins/qdp_defs.py and qdp_runner.py). These are JIT plugins: the process that
deserializes an engine using them must call `register_tensorrt_plugins()` first and run Python (TensorRT-LLM's
Python runtime does; its C++-only Triton backend does not). TensorRT's `__cuda_array_interface__` refuses bf16, so
float inputs are float32 (the kernels compute in float32 anyway).

No `from __future__ import annotations` here: TensorRT's validator (tensorrt/plugin/_validate.py, 10.11-10.14) calls
`issubclass(param.annotation, TensorDesc)` on the descriptors' annotations, which must be classes, not strings
(tests/test_tensorrt_plugin_api.py runs registration through that validator).
"""

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

NAMESPACE = "trt_redrafter"
TORCH_DTYPES = {"float32": torch.float32, "int64": torch.int64, "bool": torch.bool}


@dataclass(frozen=True)
class PluginSpec:
    name: str
    inputs: tuple[tuple[str, str], ...]  # (name, dtype)
    attrs: tuple[str, ...]  # integer attributes
    outputs: tuple[str, ...]
    output_shapes: Callable[..., tuple[tuple[tuple, str], ...]]  # (input shapes, **attrs) -> ((shape, dtype), ...)
    launch: Callable[..., None]  # (input tensors, output tensors, **attrs): writes the outputs

    @property
    def plugin_id(self) -> str:
        return f"{NAMESPACE}::{self.name}"

    def allocate(self, inputs: Sequence[torch.Tensor], **attrs) -> list[torch.Tensor]:
        """Output tensors as TensorRT would allocate them from the descriptor's shapes."""
        shapes = self.output_shapes(*[tuple(t.shape) for t in inputs], **attrs)
        return [torch.empty(shape, dtype=TORCH_DTYPES[dtype], device=inputs[0].device) for shape, dtype in shapes]

    def __call__(self, *inputs: torch.Tensor, **attrs) -> list[torch.Tensor]:
        """Run the plugin's code on torch tensors, exactly as TensorRT's impl callback does."""
        for t, (name, dtype) in zip(inputs, self.inputs):
            assert t.dtype == TORCH_DTYPES[dtype], f"{self.name}: input {name} must be {dtype}, got {t.dtype}"
        outputs = self.allocate(inputs, **attrs)
        self.launch(inputs, outputs, **attrs)
        return outputs


# ---- beam_step: one drafter beam-search selection ----------------------------------------------------------------
def _beam_step_shapes(logits, score, num_beams, warp_top_k):
    bs = logits[0]
    return ((bs, num_beams), "float32"), ((bs, num_beams), "int64"), ((bs, num_beams), "int64")


def _beam_step_launch(inputs, outputs, num_beams, warp_top_k):
    from .beam_step import beam_step

    logits, score = inputs
    res = beam_step(logits, score, num_beams, warp_top_k or None)[:3]
    for out, r in zip(outputs, res):
        out.copy_(r)


# ---- pack_beams: beams -> packed tree ------------------------------------------------------------------------------
def _pack_shapes(beams, pad_to):
    bs, nb, bl = beams[0], beams[1], beams[2]
    return (((bs, pad_to), "int64"), ((bs,), "int64"), ((bs, pad_to), "int64"), ((bs, pad_to), "int64"),
            ((bs, nb, bl), "int64"), ((bs, pad_to, pad_to), "bool"))


PACK_FIELDS = ("tokens", "lengths", "beam_positions", "position_offsets", "unpacker", "mask")


def _pack_launch(inputs, outputs, pad_to):
    from .tree_pack import pack_beams

    packed = pack_beams(inputs[0], pad_to)
    for out, field in zip(outputs, PACK_FIELDS):
        out.copy_(getattr(packed, field))


# ---- accept_tokens: longest matching drafted prefix, best beam, next token ------------------------------------------
def _accept_shapes(beams, node_tokens):
    return ((beams[0],), "int64"), ((beams[0],), "int64"), ((beams[0],), "int64")


def _accept_launch(inputs, outputs):
    from .accept import accept_tokens

    acc = accept_tokens(*inputs)
    for out, r in zip(outputs, (acc.beam_index, acc.num_accepted, acc.next_token)):
        out.copy_(r)


# ---- draw: one counter-based draw per row --------------------------------------------------------------------------
def _draw_shapes(probs, seed, position):
    return (((probs[0],), "int64"),)


def _draw_launch(inputs, outputs):
    from .accept import draw

    outputs[0].copy_(draw(*inputs))


SPECS: dict[str, PluginSpec] = {s.name: s for s in (
    PluginSpec("beam_step", (("step_logits", "float32"), ("score", "float32")), ("num_beams", "warp_top_k"),
               ("score", "parent", "token"), _beam_step_shapes, _beam_step_launch),
    PluginSpec("pack_beams", (("beams", "int64"),), ("pad_to",), PACK_FIELDS, _pack_shapes, _pack_launch),
    PluginSpec("accept_tokens", (("beams", "int64"), ("node_tokens", "int64")), (),
               ("beam_index", "num_accepted", "next_token"), _accept_shapes, _accept_launch),
    PluginSpec("draw", (("probs", "float32"), ("seed", "int64"), ("position", "int64")), (), ("token",),
               _draw_shapes, _draw_launch),
)}


# ---- TensorRT registration -----------------------------------------------------------------------------------------
_registered = False


def register_tensorrt_plugins() -> list[str]:
    """Register every wrapper with TensorRT's plugin registry (once per process); returns the plugin ids.

    Needs `tensorrt` >= 10.6 (the `tensorrt.plugin` module) and a CUDA device at run time."""
    global _registered
    from typing import Tuple

    try:
        import tensorrt as trt
        import tensorrt.plugin as trtp
    except ImportError as e:
        from ..errors import UserError

        raise UserError("the TensorRT plugin wrappers need TensorRT >= 10.6 with its Python plugin API "
                        "(tensorrt.plugin): pip install 'tensorrt>=10.6' on a machine with an NVIDIA GPU.") from e
    ids = [s.plugin_id for s in SPECS.values()]
    if _registered:
        return ids
    trt_dtype = {"float32": trt.float32, "int64": trt.int64, "bool": trt.bool}

    def descs(spec: PluginSpec, *inputs, **attrs):
        shapes = spec.output_shapes(*[tuple(d.shape_expr[i] for i in range(len(d.shape_expr))) for d in inputs],
                                    **attrs)
        return tuple(trtp.from_shape_expr(shape, dtype=trt_dtype[dtype]) for shape, dtype in shapes)

    def run(spec: PluginSpec, inputs, outputs, stream: int, **attrs) -> None:
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            spec.launch([torch.as_tensor(t, device="cuda") for t in inputs],
                        [torch.as_tensor(t, device="cuda") for t in outputs], **attrs)

    # one descriptor and one impl per plugin: tensorrt.plugin reads their signatures (inputs, attributes, types)
    @trtp.register(SPECS["beam_step"].plugin_id)
    def _beam_step_desc(step_logits: trtp.TensorDesc, score: trtp.TensorDesc, num_beams: int,
                        warp_top_k: int) -> Tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc]:
        return descs(SPECS["beam_step"], step_logits, score, num_beams=num_beams, warp_top_k=warp_top_k)

    @trtp.impl(SPECS["beam_step"].plugin_id)
    def _beam_step_impl(step_logits: trtp.Tensor, score: trtp.Tensor, num_beams: int, warp_top_k: int,
                        outputs: Tuple[trtp.Tensor], stream: int) -> None:
        run(SPECS["beam_step"], (step_logits, score), outputs, stream, num_beams=num_beams, warp_top_k=warp_top_k)

    @trtp.register(SPECS["pack_beams"].plugin_id)
    def _pack_desc(beams: trtp.TensorDesc, pad_to: int) -> Tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc,
                                                                  trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc]:
        return descs(SPECS["pack_beams"], beams, pad_to=pad_to)

    @trtp.impl(SPECS["pack_beams"].plugin_id)
    def _pack_impl(beams: trtp.Tensor, pad_to: int, outputs: Tuple[trtp.Tensor], stream: int) -> None:
        run(SPECS["pack_beams"], (beams,), outputs, stream, pad_to=pad_to)

    @trtp.register(SPECS["accept_tokens"].plugin_id)
    def _accept_desc(beams: trtp.TensorDesc, node_tokens: trtp.TensorDesc
                     ) -> Tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc]:
        return descs(SPECS["accept_tokens"], beams, node_tokens)

    @trtp.impl(SPECS["accept_tokens"].plugin_id)
    def _accept_impl(beams: trtp.Tensor, node_tokens: trtp.Tensor, outputs: Tuple[trtp.Tensor], stream: int) -> None:
        run(SPECS["accept_tokens"], (beams, node_tokens), outputs, stream)

    @trtp.register(SPECS["draw"].plugin_id)
    def _draw_desc(probs: trtp.TensorDesc, seed: trtp.TensorDesc, position: trtp.TensorDesc) -> trtp.TensorDesc:
        return descs(SPECS["draw"], probs, seed, position)[0]

    @trtp.impl(SPECS["draw"].plugin_id)
    def _draw_impl(probs: trtp.Tensor, seed: trtp.Tensor, position: trtp.Tensor, outputs: Tuple[trtp.Tensor],
                   stream: int) -> None:
        run(SPECS["draw"], (probs, seed, position), outputs, stream)

    _registered = True
    return ids


def add_plugin(network, name: str, *inputs, **attrs):
    """Add plugin `name` (a key of SPECS) to a TensorRT INetworkDefinition; returns the layer."""
    import tensorrt.plugin as trtp

    register_tensorrt_plugins()
    return network.add_plugin(getattr(getattr(trtp.op, NAMESPACE), name)(*inputs, **attrs))


def trtllm_plugin(name: str, *tensors, **attrs) -> tuple:
    """The plugin as a layer of the TensorRT-LLM network being built (inside a model's forward): tensorrt_llm
    `functional.Tensor`s in and out, as tensorrt_llm/functional.py's own layers do (`default_trtnet().add_...`, then
    `_create_tensor(layer.get_output(i), layer)`). Not exercised here: no TensorRT-LLM on the project's machines."""
    from tensorrt_llm.functional import _create_tensor, default_trtnet

    layer = add_plugin(default_trtnet(), name, *[t.trt_tensor for t in tensors], **attrs)
    return tuple(_create_tensor(layer.get_output(i), layer) for i in range(layer.num_outputs))
