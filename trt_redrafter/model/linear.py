"""The model's linear layers on the CPU: this project's AVX-512 kernel over weights packed in panels, oneDNN over a
prepacked weight, or `F.linear`.

Why prepack: a decode step multiplies a few rows (M = bs for AR, bs * tree tokens to verify a tree) by every
weight, so it is bound by reading the weights. `F.linear` on the CPU reads them in fp32 through MKL far below the
machine's read bandwidth at small M. oneDNN over a weight reordered once into its blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`, the op inductor's own freezing pass inserts) reads them faster, by how
much depending on M. `avx512` (cpu/linear.cpp, built at first use) streams weights packed in 16-column panels, in
the order it reads them, at the machine's read bandwidth for M up to a few rows, and stays ahead of oneDNN up to M
of a few dozen (`scripts/bench_linear.py --gemms` times the three on an engine's GEMMs).

Why M-invariant matters: greedy ReDrafter equals greedy AR only if a token's logits do not depend on how many
other rows share its GEMM (an AR step has M = bs, a tree step M = bs * T). `avx512` reduces every output in one
fixed order whatever M, the tiling and the threads (cpu/linear.cpp). oneDNN's prepacked GEMM gives every
row the same bits for any M >= 2, on 1 and 2 threads, at every M up to 256 tested, wherever the row sits in the
batch; at M = 1 it takes another kernel, which reduces K in another order once K is about 1k or more (SmolLM2's
MLP down-projection, K = 1536: every fp32 row differs in the last bits, 6% of bf16 rows round differently).
So oneDNN's inputs are padded to `MIN_ROWS` rows: 4, not 2, because oneDNN's kernel for 2 rows reads the
weights more slowly than its kernel for 4-6 (fp32 and bf16, 1 and 2 threads). (fp32 `F.linear` through MKL is
not M-invariant: rows of M = 1, 2, 3 differ from larger M, and at 2 threads the bits depend on the row's place in
the batch.)

Where the CPU has AMX tiles (Intel Xeon from Sapphire Rapids on), oneDNN runs bf16 GEMMs on them, 16 rows per tile
instruction, so a GEMM of 16 rows should cost about what reading its weights costs, as one row does on AVX-512, while
fewer rows may take a slower path (not measured on this project's machines: none has AMX; perf.md gives the command).
So `auto` takes oneDNN for bf16 float layers there, its inputs padded to `AMX_ROWS` rows: an AR step and every
verified tree row take the same tile kernel, and verifying a tree should cost little more than an AR step.
Before it does, `rows_invariant` checks on this machine that a row's bits do not depend on M (a oneDNN whose AMX path
did would break greedy ReDrafter == AR); if they do, auto keeps the AVX-512 kernel and says so. Weight-only layers
stay in `linear_wo` (oneDNN would run their dequantized weights: twice the bytes of int8).

Under `torch.compile`, inductor lowers `mkldnn._linear_pointwise` only when the packed weight is a graph constant
(`assert w.get_name() in V.graph.constants` in torch/_inductor/mkldnn_lowerings.py), i.e. with
`torch._inductor.config.freezing`, where inductor prepacks plain weights itself. The engine compiles without
freezing (it mutates the KV cache and slot state), so both GEMMs are registered as ops (`trt_redrafter::
onednn_linear` here, `trt_redrafter_cpu::linear` in C++): dynamo traces them, inductor calls them as external
kernels, eager calls them directly.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal, Optional, Union, get_args

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import cpu
from ..checkpoint.quantization import E4M3_MAX, dequantize_groups
from ..errors import UserError
from ..log import get_logger

logger = get_logger(__name__)

LinearImpl = Literal["torch", "onednn", "avx512"]  # resolved; RuntimeConfig.linear adds "auto"
LINEAR_IMPLS: tuple[str, ...] = get_args(LinearImpl)

# oneDNN's one-row kernel reduces in another order than its M >= 2 kernel, and its two-row kernel is slow (see
# above): inputs of fewer rows are padded to this many
MIN_ROWS = 4
# the batch-size hint of the weight reorder, which picks oneDNN's blocked layout. Measured on SmolLM2's shapes at
# M = 2..26, 1 and 2 threads: in bf16 no hint (None), 1, 4, 16 and 64 are within noise; in fp32 1 costs 30-60% and
# None up to 25% at 2 threads, 4 / 16 / 64 are the fastest. A row's bits do not depend on it (tests/test_cpu_linear.py)
PACK_BATCH_HINT: Optional[int] = 16
# oneDNN's inputs on a CPU with AMX tiles are padded to this many rows: a tile's height, so that every M takes the same
# tile kernel (see above)
AMX_ROWS = 16


def onednn_available(dtype: torch.dtype) -> bool:
    """Whether this PyTorch build and CPU run oneDNN's prepacked GEMM in `dtype` natively (bf16: AVX512-BF16 / AMX or
    at least AVX512 core, as oneDNN reports it; fp16: AVX512-FP16 / AMX-FP16)."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return dtype == torch.float32


@functools.cache
def amx_available(dtype: torch.dtype) -> bool:
    """Whether oneDNN can run `dtype` GEMMs on this CPU's AMX tiles: bfloat16 on a CPU with AMX-TILE (and AMX-BF16,
    which every AMX CPU has) and a PyTorch whose oneDNN computes bf16."""
    return dtype == torch.bfloat16 and torch.cpu._is_amx_tile_supported() and onednn_available(dtype)


def min_rows(dtype: torch.dtype) -> int:
    """Rows oneDNN's inputs are padded to (M-invariance and speed): AMX_ROWS where it runs `dtype` on AMX tiles, else
    MIN_ROWS."""
    return AMX_ROWS if amx_available(dtype) else MIN_ROWS


# (start, rows) slices of one input, each computed alone against the whole input's rows (`rows_invariant`)
_INVARIANCE_SLICES = ((0, 1), (3, 1), (1, 2), (6, 5), (2, 9), (16, 17), (0, 33), (5, 40))
# (out, in) shapes `rows_invariant` checks: K = 1536 is where oneDNN's one-row kernel reduced in another order
_INVARIANCE_SHAPES = ((96, 1536), (160, 576))


def rows_invariant(dtype: torch.dtype) -> bool:
    """Whether `onednn_linear` gives a row the same bits whatever the number of rows it shares a call with and its
    place among them, on this machine (its ISA and oneDNN's kernel choice), at this process's thread count: random
    weights of two shapes, each slice of a 45-row input computed alone against the whole."""
    return _rows_invariant(dtype, torch.get_num_threads())


@functools.cache
def _rows_invariant(dtype: torch.dtype, threads: int) -> bool:
    gen = torch.Generator().manual_seed(0)
    for n, k in _INVARIANCE_SHAPES:
        w = torch.randn(n, k, generator=gen).to(dtype)
        x = torch.randn(45, k, generator=gen).to(dtype)
        packed = prepack(w)
        whole = onednn_linear(x, packed, None)
        for start, m in _INVARIANCE_SLICES:
            if not torch.equal(onednn_linear(x[start:start + m].clone(), packed, None), whole[start:start + m]):
                return False
    return True


def resolve_linear(choice: str, device: torch.device, dtype: torch.dtype, quantized: bool = False) -> str:
    """RuntimeConfig.linear -> "torch", "onednn" or "avx512". auto on the CPU: onednn for float (not `quantized`)
    bf16 layers where oneDNN runs them on AMX tiles and keeps rows invariant (`amx_available`, `rows_invariant`);
    else avx512 where the CPU has it for `dtype` and the kernel builds (it needs a C++ compiler: the one
    torch.compile uses), else onednn where oneDNN computes `dtype` natively, else torch; torch on CUDA."""
    if choice == "torch":
        return "torch"
    assert choice in ("auto", "onednn", "avx512"), choice
    if device.type != "cpu":
        if choice != "auto":
            raise UserError(f"--linear {choice} runs on the CPU, but this engine runs on {device}; use --linear auto "
                            f"or torch.")
        return "torch"
    if choice == "auto" and not quantized and amx_available(dtype):
        if rows_invariant(dtype):
            return "onednn"
        logger.warning("oneDNN's %s GEMM on this CPU's AMX tiles gives a row other bits in calls of other row "
                       "counts (greedy ReDrafter would not equal AR): the linear layers keep the AVX-512 kernel",
                       dtype)
    if choice in ("auto", "avx512") and cpu.available(dtype):
        try:
            cpu.ops()
            return "avx512"
        except UserError as e:
            if choice == "avx512":
                raise
            logger.warning("%s; using oneDNN", e)
    elif choice == "avx512":
        raise UserError(f"--linear avx512: {cpu.unavailable_reason(dtype)}; use --linear auto, onednn or torch.")
    if onednn_available(dtype):
        return "onednn"
    if choice == "onednn":
        raise UserError(f"--linear onednn: this PyTorch build or CPU has no native oneDNN {dtype} GEMM "
                        f"(torch.backends.mkldnn / the CPU's AVX512 extensions); use --linear auto or torch.")
    return "torch"


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] on the CPU -> a copy in oneDNN's blocked layout (an opaque `torch._mkldnn` tensor of the same
    shape, only good for `onednn_linear`)."""
    assert weight.device.type == "cpu" and weight.dim() == 2, (weight.device, tuple(weight.shape))
    w = weight.detach().contiguous()
    return torch.ops.mkldnn._reorder_linear_weight(w) if PACK_BATCH_HINT is None else \
        torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT)


_LIB = torch.library.Library("trt_redrafter", "DEF")
_LIB.define("onednn_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor")


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [M, in] @ packed^T (+ bias) -> [M, out]; inputs of fewer rows padded to `min_rows` (M-invariance and speed,
    see above)."""
    M, pad = x.shape[0], min_rows(x.dtype)
    if M == 0:  # no rows (a beam search that stopped before this depth): no weight read, not `pad` rows' worth
        return x.new_empty(0, packed.shape[0])
    if M < pad:
        y = torch.ops.mkldnn._linear_pointwise(F.pad(x, (0, 0, 0, pad - M)), packed, bias, "none", [], "")
        return y[:M]
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def _onednn_linear_fake(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return x.new_empty(x.shape[0], packed.shape[0])


# every backend key: the packed weight is a MkldnnCPU tensor, the input a dense CPU one
_LIB.impl("onednn_linear", _onednn_linear, "CompositeExplicitAutograd")
torch.library.register_fake("trt_redrafter::onednn_linear", _onednn_linear_fake, lib=_LIB)
onednn_linear = torch.ops.trt_redrafter.onednn_linear


@dataclass
class QuantWeight:
    """A weight-only quantized weight W = q * s: q [out, in] int8 (int4: values in [-8, 7], one per byte here),
    s [out, in / group_size] float, one scale per output channel and group of `group_size` inputs
    (group_size = in: per channel). `dtype` is the float type the layer computes in."""

    q: torch.Tensor
    scales: torch.Tensor
    bits: int
    group_size: int
    dtype: torch.dtype
    pre_scale: Optional[torch.Tensor] = None  # [in]: AWQ's, the input is multiplied by it first (None: 1)
    # per channel only: the input may be quantized to int8 per row too, and the product taken in bytes (the
    # drafter's `w8a8` / `w4a8`; `Linear` does so where the avx512 kernels run on a CPU with VNNI, else as weight-only)
    activations: bool = False

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        """-> W [out, in] in `dtype` (q * s computed in fp32, then rounded once)."""
        return dequantize_groups(self.q, self.scales, self.group_size).to(self.dtype)

    @staticmethod
    def cat(parts: list["QuantWeight"]) -> "QuantWeight":
        """Stack along the output dimension (fused column-parallel projections)."""
        first = parts[0]
        assert all((p.bits, p.group_size, p.dtype) == (first.bits, first.group_size, first.dtype) for p in parts)
        if any(not _same(p.pre_scale, first.pre_scale) for p in parts):
            raise UserError("layers fused into one matmul (attention q/k/v, mlp.fc/mlp.gate) have different AWQ "
                            "pre-quant scales; they read the same input, so quantize them with one scale "
                            "(ModelOpt does).")
        return QuantWeight(torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts]), first.bits,
                           first.group_size, first.dtype, first.pre_scale, first.activations)


def fp8_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale (the scale cast to x's dtype, as TensorRT-LLM's FP8Linear casts it) in e4m3, saturating at +-448."""
    return (x / scale.to(x.dtype)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def fp8_qdq(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x quantized to e4m3 with `scale` and back, in x's dtype: TensorRT-LLM's FP8Linear without the FP8 GEMM plugin
    (quantize(x, scale cast to the model dtype, 'fp8') then dequantize)."""
    return fp8_quantize(x, scale).to(x.dtype) * scale.to(x.dtype)


@dataclass
class Fp8Weight:
    """An FP8 layer (TensorRT-LLM's quant_algo FP8, `quantization.py`): W = w8 * scale, and the layer's input
    quantized to e4m3 with `input_scale` before the product (per tensor, both). `dtype` is the float type the layer
    computes in."""

    w8: torch.Tensor  # [out, in] float8_e4m3fn
    scale: torch.Tensor  # fp32 scalar
    input_scale: torch.Tensor  # fp32 scalar
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.w8.shape

    def dequantize(self) -> torch.Tensor:
        """-> W [out, in] in `dtype` (w8 * scale in fp32, rounded once)."""
        return (self.w8.float() * self.scale).to(self.dtype)

    @staticmethod
    def cat(parts: list["Fp8Weight"]) -> "Fp8Weight":
        """Stack along the output dimension as TensorRT-LLM's build fuses mlp.gate and mlp.fc
        (models/modeling_utils.py `fuse_gate_mlp` @27712aa7): one weight scale, the largest, the weights
        requantized to it; one input scale, the largest (the parts read the same input)."""
        scale = torch.stack([p.scale for p in parts]).amax()
        w = torch.cat([p.w8.float() * p.scale for p in parts]) / scale
        return Fp8Weight(w.to(torch.float8_e4m3fn), scale, torch.stack([p.input_scale for p in parts]).amax(),
                         parts[0].dtype)


def scaled_mm_available(device: torch.device) -> bool:
    """Whether `torch._scaled_mm` runs FP8 GEMMs on `device`: CUDA with compute capability 8.9 or later (Ada,
    Hopper, Blackwell)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _same(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


class Linear(nn.Module):
    """y = x W^T (+ b) with a frozen W [out, in]: `F.linear` ("torch"), or `onednn_linear` / the avx512 kernel over W
    packed at construction ("onednn" / "avx512"); the unpacked W is then not kept (pass a copy if something else
    still reads it).

    A `QuantWeight` with `activations` (int8 per channel) runs in the avx512 kernel's `linear_w8a8` on a CPU with
    VNNI: the input quantized to int8 per row, the product in bytes (not the float layer's values: for the drafter,
    which only proposes), at any number of rows.
    Any other `QuantWeight` runs in the avx512 kernel's weight-only path (`linear_wo`: int8 / int4 bytes read, scaled in
    registers), on CUDA in the Triton weight-only GEMM (plugins/weight_only.py: the same bytes, scaled per group in
    fp32), and under any other impl as its dequantized float weight (the same quantized model, no bandwidth
    saved).

    An `Fp8Weight` runs through `torch._scaled_mm` (e4m3 x e4m3, fp32 accumulation) where the GPU has FP8 GEMMs
    (`scaled_mm_available`); elsewhere (the CPU, older GPUs) as its dequantized weight under the input's e4m3
    quantize-dequantize (`fp8_qdq`), TensorRT-LLM's own non-plugin FP8 path: the same values in, no bandwidth or
    compute saved."""

    def __init__(self, weight: Union[torch.Tensor, QuantWeight, Fp8Weight], bias: Optional[torch.Tensor] = None,
                 impl: str = "torch"):
        super().__init__()
        assert impl in LINEAR_IMPLS, impl
        self.impl = impl
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else _frozen(bias)  # [out]
        self.weight: Optional[nn.Parameter] = None
        self.packed: Optional[torch.Tensor] = None  # a plain attribute: module moves and state dicts skip it
        self.quant: Optional[tuple[torch.Tensor, int, int]] = None  # weight-only: (packed scales, bits, group size)
        self.pre_scale: Optional[torch.Tensor] = None  # [in], AWQ's input scale
        self.input_scale: Optional[torch.Tensor] = None  # FP8: the input's e4m3 scale (fp32 scalar)
        self.fp8: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # FP8 GEMMs: (w8 [out, in], its scale)
        # int8 (int4) weights and int8 activations: (column sums, scales padded to whole panels, fp32 bias or None, the
        # weight's bits)
        self.w8a8: Optional[tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], int]] = None
        self.quant_pairs = False  # `quant` on the CPU with bf16 inputs: VDPBF16PS over k pairs (cpu.wo_pairs)
        if isinstance(weight, Fp8Weight):
            self.input_scale = weight.input_scale
            if impl == "torch" and scaled_mm_available(weight.w8.device):
                self.fp8 = (weight.w8.contiguous(), weight.scale)
                return
            weight = weight.dequantize()
        if isinstance(weight, QuantWeight):
            if weight.pre_scale is not None:
                self.pre_scale = weight.pre_scale.to(weight.dtype)
            if (impl == "avx512" and weight.activations and weight.pre_scale is None
                    and weight.group_size == weight.q.shape[1] and cpu.vnni_available()):
                self.packed, colsum, scales = cpu.pack_w8a8(weight.q, weight.scales, weight.bits)
                self.w8a8 = (colsum, scales, None if bias is None else bias.float(), weight.bits)
                return
            if impl == "avx512":
                self.packed, scales = cpu.pack_wo(weight.q, weight.scales, weight.bits)
                self.quant = (scales, weight.bits, weight.group_size)
                self.quant_pairs = cpu.wo_pairs(weight.dtype, weight.group_size)
                return
            if weight.q.is_cuda and _cuda_weight_only():
                from ..plugins import weight_only
                self.packed, scales = weight_only.pack(weight.q, weight.scales, weight.bits, weight.group_size)
                self.quant = (scales, weight.bits, weight.group_size)
                return
            weight = weight.dequantize()
        if impl == "torch":
            self.weight = _frozen(weight)
            return
        assert bias is None or bias.dtype == weight.dtype, (bias.dtype, weight.dtype)
        self.packed = prepack(weight) if impl == "onednn" else cpu.ops().pack(weight.detach().contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out]."""
        if self.pre_scale is not None:
            x = x * self.pre_scale
        if self.fp8 is not None:
            return self._scaled_mm(x)
        if self.input_scale is not None:
            x = fp8_qdq(x, self.input_scale)
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.w8a8 is not None:
            colsum, scales, bias, bits = self.w8a8
            y = torch.ops.trt_redrafter_cpu.linear_w8a8(x2, self.packed, colsum, scales, self.out_features, bias, bits)
        elif self.quant is not None and self.packed.is_cuda:
            from ..plugins import weight_only
            scales, bits, group_size = self.quant
            y = weight_only.wo_linear(x2.contiguous(), self.packed, scales, bits, group_size)
            if self.bias is not None:
                y = y + self.bias
        elif self.quant is not None:
            scales, bits, group_size = self.quant
            y = torch.ops.trt_redrafter_cpu.linear_wo(x2, self.packed, scales, bits, group_size, self.out_features,
                                                      self.bias)
        elif self.impl == "avx512":
            y = torch.ops.trt_redrafter_cpu.linear(x2, self.packed, self.out_features, self.bias)
        else:
            y = onednn_linear(x2, self.packed, self.bias)
        return y.view(*lead, self.out_features)

    def _scaled_mm(self, x: torch.Tensor) -> torch.Tensor:
        """FP8 GEMM: x quantized to e4m3 with the input scale, times w8, both scales applied in the epilogue; rows
        padded to a multiple of 16 (cuBLASLt's FP8 GEMMs want aligned dimensions)."""
        w8, scale = self.fp8
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        M = x2.shape[0]
        xq = fp8_quantize(x2, self.input_scale)
        if M % 16:
            xq = F.pad(xq.view(torch.int8), (0, 0, 0, 16 - M % 16)).view(torch.float8_e4m3fn)
        y = torch._scaled_mm(xq, w8.t(), scale_a=self.input_scale, scale_b=scale, out_dtype=x.dtype)[:M]
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)

    @property
    def path(self) -> str:
        """The kernel this layer runs and what it reads, e.g. "avx512 float32", "avx512 int8 weights", "onednn
        bfloat16 (AMX tiles)", "torch float32" (bench-engine counts the layers by it)."""
        if self.fp8 is not None:
            return "fp8 GEMM (torch._scaled_mm)"
        if self.w8a8 is not None:
            return f"avx512 int{self.w8a8[3]} weights, int8 activations (VNNI)"
        if self.quant is not None:
            pairs = ", bf16 pairs (VDPBF16PS)" if self.quant_pairs else ""
            return f"{'triton' if self.packed.is_cuda else self.impl} int{self.quant[1]} weights{pairs}"
        dtype = str((self.weight if self.weight is not None else self.packed).dtype).removeprefix("torch.")
        fp8 = ", fp8 model" if self.input_scale is not None else ""
        amx = " (AMX tiles)" if self.impl == "onednn" and amx_available(self.packed.dtype) else ""
        return f"{self.impl} {dtype}{amx}{fp8}"

    def extra_repr(self) -> str:
        if self.input_scale is not None:
            return f"{self.in_features} -> {self.out_features}, {'fp8 GEMM' if self.fp8 else self.impl + ', fp8 model'}"
        q = f", int{self.quant[1]} weights{' (triton)' if self.packed.is_cuda else ''}" if self.quant else \
            f", int{self.w8a8[3]} weights, int8 activations" if self.w8a8 else ""
        return f"{self.in_features} -> {self.out_features}, {self.impl}{q}"


@functools.cache
def _cuda_weight_only() -> bool:
    """Whether the Triton weight-only GEMM (plugins/weight_only.py) can run: triton is importable."""
    try:
        import triton  # noqa: F401
    except ImportError:
        logger.warning("triton is not installed: weight-only layers on CUDA run their dequantized weights")
        return False
    return True


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return t if isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=False)


def linear_paths(*modules: Optional[nn.Module]) -> dict[str, int]:
    """How many of the modules' linear layers run each `Linear.path`, most first."""
    counts: dict[str, int] = {}
    for m in modules:
        for layer in (m.modules() if m is not None else ()):
            if isinstance(layer, Linear):
                counts[layer.path] = counts.get(layer.path, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))
