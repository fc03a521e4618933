"""Weight-only quantized bases in TensorRT-LLM's checkpoint format: what `convert --quantize` writes, what the torch
backend reads, and the quantizer both sides use.

TensorRT-LLM (NVIDIA/TensorRT-LLM, read at the commits named; docs/tensorrt-llm.md "Quantized bases"):
- `quantization.quant_algo` "W8A16" / "W4A16": weight-only int8 / int4, one scale per output channel.
  `examples/quantization/quantize.py --qformat int8_wo|int4_wo` writes such a checkpoint with the weights still in
  float and the algorithm set (`quantization/quantize_by_modelopt.py` @042c510d); `trtllm-build` quantizes them
  (`models/modeling_utils.py` `preprocess_weights` -> `weight_only_quantize_dict` @01ea6d79, which leaves weights
  that are already int8 alone). `convert --quantize int8_wo|int4_wo` writes that form. The other form, what
  `convert_checkpoint.py --use_weight_only` writes, holds int8 weights already run through CUTLASS's mixed-GEMM
  preprocessing (`symmetric_quantize_last_axis_of_batched_matrix`, thop/weightOnlyQuantOp.cpp @23bc5b7c), whose
  byte order depends on the GPU it ran on (`getSMVersion()`): this backend refuses it, naming the float form.
- The quantizer (cpp/tensorrt_llm/kernels/cutlass_kernels/cutlass_preprocessors.cpp `symmetric_quantize` @05316d3):
  per output channel, scale = amax * 1/128 (int8) or 1/8 (int4) in fp32; q = round(w / scale) (half away from zero)
  clamped to [-128, 127] or [-8, 7]; the stored scale is rounded to the model dtype. `quantize_per_channel` below is
  the same computation, so this backend runs the model TensorRT-LLM would build from the same checkpoint.
- `quantization.exclude_modules` null means TensorRT-LLM's default list (`quantization/quantize.py`
  `quantize_layers` @89fd9b74: lm_head, vocab_embedding, ...), fnmatch patterns over module names; a list replaces
  the default. TensorRT-LLM's ReDrafter converter adds the drafter's modules only to a list that exists, so a
  ReDrafter checkpoint of a quantized base always carries one (`convert` writes the default list explicitly).
- `quant_algo` "W4A16_AWQ" (quantize.py --qformat int4_awq, through NVIDIA ModelOpt): int4 with one scale per
  output channel and group of `group_size` inputs, stored quantized and GPU-independent (the build preprocesses
  it): `X.weight` int8 [out / 2, in], output rows 2j and 2j + 1 in the low and high nibble of one byte (ModelOpt
  `pack_int4_in_uint8`, modelopt/torch/export/quant_utils.py @0338c843), `X.weights_scaling_factor` [out, in /
  group] = group amax / 7, `X.prequant_scaling_factor` [in] that the input is multiplied by (AWQ's activation-
  aware smoothing; the weight was divided by it before quantizing), config `group_size`, `pre_quant_scale: true`
  (TensorRT-LLM `models/modeling_utils.py` `preprocess_weights` @01ea6d79 reads them). `convert --quantize int4_awq`
  writes this layout, its pre-quant scales from AWQ's search over calibration prompts (checkpoint/awq.py), or 1
  (round-to-nearest per group) without calibration.

Tensor parallelism: TensorRT-LLM quantizes each rank's slice, so a row-parallel layer's scales (attention.dense,
mlp.proj, split along their inputs) come from that rank's columns only and a TP=2 engine is a slightly different
model from a TP=1 one. This backend takes each output channel's amax over every rank (one all-reduce at load), so
the quantized model, and with it the output, does not depend on TP.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Optional

import torch

from ..errors import UserError

# convert --quantize MODE -> (TensorRT-LLM quant_algo, bits); names as quantize.py's --qformat
MODES: dict[str, tuple[str, int]] = {"int8_wo": ("W8A16", 8), "int4_wo": ("W4A16", 4), "int4_awq": ("W4A16_AWQ", 4)}
ALGO_BITS = {algo: bits for algo, bits in MODES.values()}
GROUPED = "W4A16_AWQ"  # the one algorithm stored quantized, with per-group scales
GROUP_SIZES = (64, 128)  # TensorRT-LLM's group-wise kernels' sizes (quantize.py --awq_block_size)

# quantization/quantize.py `quantize_layers`: what `exclude_modules: null` means
DEFAULT_EXCLUDE = ["*lm_head", "*router", "*vocab_embedding", "*position_embedding", "*block_embedding",
                   "*shared_expert_gate"]

# the base's linear layers, by TensorRT-LLM module name under transformer.layers.{i}.
LAYER_LINEARS = ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj")


@dataclass(frozen=True)
class WeightOnly:
    """A checkpoint's quantization: `bits` per weight, one scale per output channel (or per `group_size` inputs),
    the modules named by `exclude` (fnmatch patterns) left in float. Any TensorRT-LLM algorithm is read (FP8 too:
    `bits` 0); the torch backend runs the weight-only ones (`require_torch_runs`)."""

    algo: Optional[str]  # None with a quantized KV cache alone
    bits: int  # 0: not a weight-only algorithm the torch backend runs (`require_torch_runs`)
    exclude: tuple[str, ...]
    group_size: Optional[int] = None  # W4A16_AWQ: inputs per scale; None: one scale per output channel
    kv_cache_algo: Optional[str] = None  # a quantized KV cache (FP8, INT8): TensorRT-LLM only

    @property
    def stored_quantized(self) -> bool:
        return self.algo == GROUPED

    def quantizes(self, module: str) -> bool:
        return self.algo is not None and not any(fnmatch.fnmatchcase(module, pattern) for pattern in self.exclude)


def parse_quantization(raw: dict, where: str) -> Optional[WeightOnly]:
    """The checkpoint config's `quantization` section -> WeightOnly, or None for an unquantized base. Any algorithm
    is read (the trtllm backend builds FP8 and the rest); `require_torch_runs` says whether the torch backend can."""
    q = raw.get("quantization") or {}
    if not isinstance(q, dict):
        raise UserError(f"{where}: quantization must be an object, got {q!r}.")
    algo = q.get("quant_algo")
    kv = q.get("kv_cache_quant_algo")
    if algo is None and kv is None:
        return None
    exclude = q.get("exclude_modules")
    if exclude is not None and (not isinstance(exclude, list) or not all(isinstance(e, str) for e in exclude)):
        raise UserError(f"{where}: quantization.exclude_modules must be a list of module names, got {exclude!r}.")
    group = None
    if algo == GROUPED:
        group = q.get("group_size", 128)
        if not isinstance(group, int) or group < 2 or group % 2:
            raise UserError(f"{where}: quantization.group_size must be an even positive integer, got {group!r}.")
        if q.get("has_zero_point"):
            raise UserError(f"{where}: has_zero_point: this backend runs symmetric int4 (ModelOpt's int4_awq), "
                            f"not zero-point (GPTQ) checkpoints.")
    return WeightOnly(algo, ALGO_BITS.get(algo, 0), tuple(DEFAULT_EXCLUDE if exclude is None else exclude), group,
                      kv)


def require_torch_runs(quant: Optional[WeightOnly], where: str) -> None:
    """Refuse, by name, a quantization the torch backend does not run."""
    if quant is None:
        return
    if quant.kv_cache_algo:
        raise UserError(f"{where}: kv_cache_quant_algo {quant.kv_cache_algo!r}: the torch backend keeps the KV cache "
                        f"in the model dtype; build it with --backend trtllm, or convert without a quantized KV cache.")
    if quant.algo is not None and quant.algo not in ALGO_BITS:
        raise UserError(f"{where}: quant_algo {quant.algo!r} is not one the torch backend runs (it runs "
                        f"{', '.join(ALGO_BITS)}: `convert --quantize {'|'.join(MODES)}`); build it with --backend "
                        f"trtllm.")


def quantization_section(mode: Optional[str], quantize_lm_head: bool = False, group_size: int = 128) -> dict:
    """The `quantization` keys `convert --quantize MODE` sets (the rest keep their defaults)."""
    if mode is None:
        return {}
    if mode not in MODES:
        raise UserError(f"--quantize: expected one of {', '.join(MODES)}, got {mode!r}.")
    exclude = [p for p in DEFAULT_EXCLUDE if not (quantize_lm_head and p == "*lm_head")]
    out = {"quant_algo": MODES[mode][0], "exclude_modules": exclude}
    if MODES[mode][0] == GROUPED:
        out.update(group_size=group_size, has_zero_point=False, pre_quant_scale=True)
    return out


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    return torch.sign(x) * torch.floor(x.abs() + 0.5)  # C's round(), not torch.round's half to even


def channel_amax(w: torch.Tensor) -> torch.Tensor:
    """w [out, in] -> |w| max per output channel [out], fp32."""
    return w.detach().float().abs().amax(dim=1)


def quantize_per_channel(w: torch.Tensor, bits: int, scale_dtype: torch.dtype,
                         amax: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (q [out, in] int8, scales [out, 1] in `scale_dtype`): TensorRT-LLM's symmetric_quantize (module
    docstring). `amax` [out] overrides w's own (a row-parallel rank's slice takes the whole row's)."""
    amax = channel_amax(w) if amax is None else amax.float()
    scale = amax * (1.0 / float(1 << (bits - 1)))  # [out] fp32, as the quantizer divides by it
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = _round_half_away(w.detach().float() / safe[:, None]).clamp(lo, hi)
    q = torch.where(scale[:, None] == 0, torch.zeros_like(q), q)
    return q.to(torch.int8), scale.to(scale_dtype)[:, None]


def refuse_preprocessed(tensors: dict[str, torch.Tensor], name: str, where: str) -> None:
    """An int8 weight with a per_channel_scale is CUTLASS-preprocessed for one GPU architecture (module docstring)."""
    if tensors[name].dtype == torch.int8:
        raise UserError(f"{where}: {name} is int8, written by TensorRT-LLM's convert_checkpoint.py --use_weight_only "
                        f"in CUTLASS's mixed-GEMM layout for the GPU it ran on, which this backend cannot read; "
                        f"convert the base with `trt-redrafter convert --quantize int8_wo|int4_wo` or TensorRT-LLM's "
                        f"quantize.py --qformat int8_wo|int4_wo (float weights, quantized at build).")


# ---- W4A16_AWQ: stored quantized, per group ---------------------------------------------------------------------

def quantize_groups(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (q [out, in] int8 in [-8, 7], scales [out, in / group] fp32): ModelOpt's int4 block
    quantizer, scale = group amax / 7, q = round(w / scale) clamped (a zero group: scale 0, q 0)."""
    out, k = w.shape
    g = w.detach().float().reshape(out, k // group_size, group_size)
    scale = g.abs().amax(dim=2) / 7.0
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round(g / safe[..., None]).clamp(-8, 7)
    q = torch.where(scale[..., None] == 0, torch.zeros_like(q), q)
    return q.reshape(out, k).to(torch.int8), scale


def pack_int4_rows(q: torch.Tensor) -> torch.Tensor:
    """q [out, in] int8 in [-8, 7] -> [out / 2, in] int8: rows 2j and 2j + 1 in the low and high nibble."""
    u = q.view(torch.uint8)
    return ((u[0::2] & 0xF) | ((u[1::2] & 0xF) << 4)).view(torch.int8).contiguous()


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4_rows`: [out / 2, in] -> q [out, in] int8, each nibble sign-extended."""
    lo = torch.bitwise_right_shift(torch.bitwise_left_shift(packed, 4), 4)  # int8: arithmetic shifts
    hi = torch.bitwise_right_shift(packed, 4)
    return torch.stack([lo, hi], dim=1).reshape(-1, packed.shape[1])


def awq_tensors(w: torch.Tensor, group_size: int, dtype: torch.dtype,
                smooth: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
    """One linear layer's W4A16_AWQ tensors (suffixes after the module name) from its float weight [out, in] and
    AWQ's input-channel scale `smooth` [in] (checkpoint/awq.py; None: 1): Q(W s) and the pre-quant scale 1 / s, in
    the model dtype (W is multiplied by the inverse of that rounded value, so the two cancel as stored)."""
    out, k = w.shape
    if out % 2 or k % group_size:
        raise UserError(f"int4_awq needs an even number of outputs and inputs divisible by the group size "
                        f"{group_size}; a layer has [{out}, {k}]: choose --group-size among "
                        f"{', '.join(str(g) for g in GROUP_SIZES if k % g == 0) or 'none that divides it'}.")
    pre = torch.ones(k, dtype=dtype) if smooth is None else (1.0 / smooth.float()).to(dtype)
    q, scales = quantize_groups(w.float() / pre.float(), group_size)
    return {"weight": pack_int4_rows(q), "weights_scaling_factor": scales, "prequant_scaling_factor": pre}


def check_group_size(model, tp: int, group_size: int) -> None:
    """Every int4_awq layer's inputs per rank must be whole groups: hidden_size (qkv, fc, gate; attention.dense's
    hidden / tp) and intermediate_size / tp (mlp.proj)."""
    ins = [("hidden_size", model.hidden_size), (f"hidden_size / tp ({tp})", model.hidden_size // tp),
           (f"intermediate_size / tp ({tp})", model.intermediate_size // tp)]
    bad = [(what, n) for what, n in ins if n % group_size]
    if bad:
        fits = [g for g in GROUP_SIZES if all(n % g == 0 for _, n in ins)]
        raise UserError(f"--group-size {group_size} does not divide {bad[0][0]} = {bad[0][1]} (int4_awq quantizes "
                        f"each layer's inputs in whole groups per rank); use --group-size "
                        f"{' or '.join(map(str, fits)) if fits else 'of another size: none of 64, 128 fits'}.")


def read_awq(tensors: dict[str, torch.Tensor], module: str, group_size: int, where: str
             ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """A W4A16_AWQ layer -> (q [out, in] int8, scales [out, in / group], pre-quant scale [in] or None when it is 1)."""
    need = [module + ".weight", module + ".weights_scaling_factor"]
    missing = [n for n in need if n not in tensors]
    if missing:
        raise UserError(f"{where}: a W4A16_AWQ checkpoint lacks {', '.join(missing)}.")
    packed, scales = tensors[need[0]], tensors[need[1]]
    if packed.dtype not in (torch.int8, torch.uint8):
        raise UserError(f"{where}: {need[0]} is {packed.dtype}; W4A16_AWQ stores int4 pairs in int8.")
    q = unpack_int4_rows(packed.view(torch.int8))
    if tuple(scales.shape) != (q.shape[0], q.shape[1] // group_size):
        raise UserError(f"{where}: {need[1]} has shape {tuple(scales.shape)}, expected "
                        f"[{q.shape[0]}, {q.shape[1] // group_size}] for group size {group_size}.")
    pre = tensors.get(module + ".prequant_scaling_factor")
    if pre is not None and bool((pre == 1).all()):
        pre = None
    return q, scales, None if pre is None else pre.reshape(-1)


ROW_PARALLEL = ("attention.dense", "mlp.proj")  # their inputs are split across ranks


def store_quantized(tensors: dict[str, torch.Tensor], quant: Optional[WeightOnly], num_layers: int,
                    dtype: torch.dtype, smooth: Optional[dict[str, torch.Tensor]] = None, tp_size: int = 1,
                    rank: int = 0) -> dict[str, torch.Tensor]:
    """A rank's float base tensors -> the form its checkpoint stores: W4A16_AWQ layers quantized and packed, every
    other algorithm's weights left in float (TensorRT-LLM's build and this backend's load quantize them).
    `smooth`: AWQ's input scales over each module's full input (checkpoint/awq.py), sliced here for row-parallel
    layers; groups never straddle ranks, so every rank's int4 values and scales are those of TP 1."""
    if quant is None or not quant.stored_quantized:
        return tensors
    modules = [f"transformer.layers.{i}.{m}" for i in range(num_layers) for m in LAYER_LINEARS] + ["lm_head"]
    out = dict(tensors)
    for module in modules:
        if quant.quantizes(module) and module + ".weight" in out:
            w = out.pop(module + ".weight")
            s = (smooth or {}).get(module)
            if s is not None and module.endswith(ROW_PARALLEL) and tp_size > 1:
                s = s.chunk(tp_size)[rank]
            out.update({f"{module}.{k}": v for k, v in awq_tensors(w, quant.group_size, dtype, s).items()})
    return out
