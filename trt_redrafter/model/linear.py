"""The model's linear layers: `F.linear`, or on the CPU one oneDNN GEMM over a weight prepacked once at load.

Why prepack: a decode step multiplies a few rows (M = bs for AR, bs * tree tokens to verify a tree) by every
weight, so it is bound by reading the weights. `F.linear` on the CPU reads them in fp32 through MKL at 4-7 GB/s at
small M, and in bf16 reorders the weight on every call; oneDNN over a weight reordered once into its blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`, the op inductor's own freezing pass inserts) reads bf16 weights at
about twice the rate of fp32 `F.linear`, and verifying 4-16 rows costs little more than 1 (SmolLM2-135M's GEMMs
of one step, 1 thread: fp32 `F.linear` 18.7 ms at M = 1, 75 at M = 16; bf16 oneDNN 9.2 and 25).

Why M-invariant matters: greedy ReDrafter equals greedy AR only if a token's logits do not depend on how many
other rows share its GEMM (an AR step has M = bs, a tree step M = bs * T). oneDNN's prepacked GEMM gives every
row the same bits for any M >= 2, on 1 and 2 threads, at every M up to 256 tested, wherever the row sits in the
batch; at M = 1 it takes another kernel, which reduces K in another order once K is about 1k or more (SmolLM2's
MLP down-projection, K = 1536: every fp32 row differs in the last bits, 6% of bf16 rows round differently).
So the op below pads a one-row input to `MIN_ROWS` rows. (fp32 `F.linear` through MKL is not M-invariant: rows
of M = 1, 2, 3 differ from larger M, and at 2 threads the bits depend on the row's place in the batch.)

Under `torch.compile`, inductor lowers `mkldnn._linear_pointwise` only when the packed weight is a graph constant
(`assert w.get_name() in V.graph.constants` in torch/_inductor/mkldnn_lowerings.py), i.e. with
`torch._inductor.config.freezing`, where inductor prepacks plain weights itself. The engine compiles without
freezing (it mutates the KV cache and slot state), so the GEMM is registered here as the op
`trt_redrafter::onednn_linear`: dynamo traces it, inductor calls it as an external kernel, eager calls it directly.
"""

from __future__ import annotations

from typing import Literal, Optional, get_args

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import UserError

LinearImpl = Literal["torch", "onednn"]  # resolved; RuntimeConfig.linear adds "auto"
LINEAR_IMPLS: tuple[str, ...] = get_args(LinearImpl)

# oneDNN's one-row kernel reduces in another order than its M >= 2 kernel (see above): one-row inputs are padded
MIN_ROWS = 2
# the batch-size hint of the weight reorder, which picks oneDNN's blocked layout. Measured on SmolLM2's shapes at
# M = 2..26, 1 and 2 threads: in bf16 no hint (None), 1, 4, 16 and 64 are within noise; in fp32 1 costs 30-60% and
# None up to 25% at 2 threads, 4 / 16 / 64 are the fastest. A row's bits do not depend on it (tests/test_cpu_linear.py)
PACK_BATCH_HINT: Optional[int] = 16


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


def resolve_linear(choice: str, device: torch.device, dtype: torch.dtype) -> str:
    """RuntimeConfig.linear -> "torch" or "onednn". auto: onednn on a CPU where oneDNN computes `dtype` natively
    (measured faster than `F.linear` there at every M from 1 to 32, fp32 and bf16), torch elsewhere and on CUDA."""
    if choice == "torch":
        return "torch"
    assert choice in ("auto", "onednn"), choice
    if device.type != "cpu":
        if choice == "onednn":
            raise UserError(f"--linear onednn runs on the CPU, but this engine runs on {device}; use --linear auto "
                            f"or torch.")
        return "torch"
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
    """x [M, in] @ packed^T (+ bias) -> [M, out]; one-row inputs padded to MIN_ROWS (M-invariance, see above)."""
    M = x.shape[0]
    if M < MIN_ROWS:
        y = torch.ops.mkldnn._linear_pointwise(F.pad(x, (0, 0, 0, MIN_ROWS - M)), packed, bias, "none", [], "")
        return y[:M]
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def _onednn_linear_fake(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return x.new_empty(x.shape[0], packed.shape[0])


# every backend key: the packed weight is a MkldnnCPU tensor, the input a dense CPU one
_LIB.impl("onednn_linear", _onednn_linear, "CompositeExplicitAutograd")
torch.library.register_fake("trt_redrafter::onednn_linear", _onednn_linear_fake, lib=_LIB)
onednn_linear = torch.ops.trt_redrafter.onednn_linear


class Linear(nn.Module):
    """y = x W^T (+ b) with a frozen W [out, in]: `F.linear` ("torch"), or ("onednn") `onednn_linear` over W packed
    at construction; the unpacked W is then not kept (pass a copy if something else still reads it)."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, impl: str = "torch"):
        super().__init__()
        assert impl in LINEAR_IMPLS, impl
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else _frozen(bias)  # [out]
        self.weight: Optional[nn.Parameter] = None
        self.packed: Optional[torch.Tensor] = None  # a plain attribute: module moves and state dicts skip it
        if impl == "onednn":
            assert bias is None or bias.dtype == weight.dtype, (bias.dtype, weight.dtype)
            self.packed = prepack(weight)
        else:
            self.weight = _frozen(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out]."""
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        lead = x.shape[:-1]
        return onednn_linear(x.reshape(-1, self.in_features), self.packed, self.bias).view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {'onednn' if self.packed is not None else 'torch'}"


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return t if isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=False)
