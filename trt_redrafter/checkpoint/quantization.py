"""Quantized bases in TensorRT-LLM's checkpoint format (weight-only int8 / int4, FP8): what `convert --quantize`
writes, what the torch backend reads, and the quantizer both sides use.

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

- `quant_algo` "FP8" (quantize.py --qformat fp8, through ModelOpt): per tensor, `X.weight` float8_e4m3fn [out, in],
  `X.weights_scaling_factor` and `X.activation_scaling_factor` fp32 [1] (TensorRT-LLM `quantization/layers.py`
  FP8Linear / FP8RowLinear @2340c776), each amax / 448 (ModelOpt `get_scaling_factor` and `to_quantized_weight`,
  modelopt/torch/export/quant_utils.py). The layer quantizes its input to e4m3 with its activation scale and
  multiplies in FP8. `convert --quantize fp8` writes this layout, the input amax from calibration prompts
  (checkpoint/calibration.py). The torch backend runs it through torch._scaled_mm where the GPU has FP8 GEMMs, and
  elsewhere as the dequantized weight under the input's e4m3 quantize-dequantize (model/linear.py).

Tensor parallelism: TensorRT-LLM quantizes each rank's slice, so a row-parallel layer's scales (attention.dense,
mlp.proj, split along their inputs) come from that rank's columns only and a TP=2 engine is a slightly different
model from a TP=1 one. This backend takes each output channel's amax over every rank (one all-reduce at load), so
the quantized model, and with it the output, does not depend on TP. FP8's per-tensor scales are taken over the
whole layer when the checkpoint is written, so every rank shares them.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Optional

import torch

from ..errors import UserError

# convert --quantize MODE -> (TensorRT-LLM quant_algo, bits per weight of a weight-only algorithm, else 0); names as
# quantize.py's --qformat
MODES: dict[str, tuple[str, int]] = {"int8_wo": ("W8A16", 8), "int4_wo": ("W4A16", 4), "int4_awq": ("W4A16_AWQ", 4),
                                     "fp8": ("FP8", 0)}
ALGO_BITS = {algo: bits for algo, bits in MODES.values()}  # the algorithms the torch backend runs
GROUPED = "W4A16_AWQ"  # weight-only int4 stored quantized, with per-group scales
FP8 = "FP8"  # e4m3 weights and inputs, one scale per tensor each, stored quantized
CALIBRATED = (GROUPED, FP8)  # the algorithms whose scales come from calibration prompts
E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value (ModelOpt's maxbound for FP8)
GROUP_SIZES = (64, 128)  # TensorRT-LLM's group-wise kernels' sizes (quantize.py --awq_block_size)

# quantization/quantize.py `quantize_layers`: what `exclude_modules: null` means
DEFAULT_EXCLUDE = ["*lm_head", "*router", "*vocab_embedding", "*position_embedding", "*block_embedding",
                   "*shared_expert_gate"]

# the base's linear layers, by TensorRT-LLM module name under transformer.layers.{i}.
LAYER_LINEARS = ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj")


@dataclass(frozen=True)
class Quantization:
    """A checkpoint's quantization: weight-only (`bits` per weight, one scale per output channel or per `group_size`
    inputs) or FP8 (`bits` 0), the modules named by `exclude` (fnmatch patterns) left in float. Any TensorRT-LLM
    algorithm is read; the torch backend runs those of `MODES` (`require_torch_runs`)."""

    algo: Optional[str]  # None with a quantized KV cache alone
    bits: int  # weight-only bits; 0 for FP8 and for algorithms the torch backend does not run
    exclude: tuple[str, ...]
    group_size: Optional[int] = None  # W4A16_AWQ: inputs per scale; None: one scale per output channel
    kv_cache_algo: Optional[str] = None  # a quantized KV cache (FP8, INT8): TensorRT-LLM only

    @property
    def stored_quantized(self) -> bool:
        """Whether the checkpoint holds the quantized values (W4A16_AWQ, FP8), not float weights the build
        quantizes."""
        return self.algo in CALIBRATED

    @property
    def fp8(self) -> bool:
        return self.algo == FP8

    def quantizes(self, module: str) -> bool:
        return self.algo is not None and not any(fnmatch.fnmatchcase(module, pattern) for pattern in self.exclude)


def parse_quantization(raw: dict, where: str) -> Optional[Quantization]:
    """The checkpoint config's `quantization` section -> Quantization, or None for an unquantized base. Any algorithm
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
    return Quantization(algo, ALGO_BITS.get(algo, 0), tuple(DEFAULT_EXCLUDE if exclude is None else exclude), group,
                        kv)


def require_torch_runs(quant: Optional[Quantization], where: str) -> None:
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
    amax = channel_amax(w) if amax is None else amax.float().to(w.device)
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


def dequantize_groups(q: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """q [out, in] and scales [out, ceil(in / group)] -> q * s [out, in] in fp32 (a per-channel scale is one group
    of the whole row)."""
    return q.float() * scales.float().repeat_interleave(group_size, dim=1)[:, :q.shape[1]]


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


# ---- FP8: e4m3 weights and inputs, one scale each per tensor, stored quantized ------------------------------------

def fp8_tensors(w: torch.Tensor, weight_amax: float, input_amax: float) -> dict[str, torch.Tensor]:
    """One linear layer's FP8 tensors (suffixes after the module name), as ModelOpt exports them for TensorRT-LLM:
    scale = amax / 448 in fp32 (`get_scaling_factor`), weight = (w / scale) cast to e4m3 (`to_quantized_weight`),
    both scales of shape [1] (TensorRT-LLM's FP8Linear parameters). `weight_amax` is taken over the whole layer (all
    ranks; q, k and v together), so every rank's slice shares one scale; `input_amax` is the calibration inputs'."""
    ws = torch.tensor([max(weight_amax, 1e-12) / E4M3_MAX], dtype=torch.float32, device=w.device)
    xs = torch.tensor([max(input_amax, 1e-12) / E4M3_MAX], dtype=torch.float32, device=w.device)
    return {"weight": (w.detach().float() / ws).to(torch.float8_e4m3fn), "weights_scaling_factor": ws,
            "activation_scaling_factor": xs}


def read_fp8(tensors: dict[str, torch.Tensor], module: str, where: str
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An FP8 layer -> (weight [out, in] float8_e4m3fn, weight scale, input scale: fp32 scalars)."""
    need = [module + s for s in (".weight", ".weights_scaling_factor", ".activation_scaling_factor")]
    missing = [n for n in need if n not in tensors]
    if missing:
        raise UserError(f"{where}: an FP8 checkpoint lacks {', '.join(missing)}.")
    w, ws, xs = (tensors[n] for n in need)
    if w.dtype not in (torch.float8_e4m3fn, torch.int8, torch.uint8):
        raise UserError(f"{where}: {need[0]} is {w.dtype}; an FP8 checkpoint stores float8_e4m3fn weights.")
    for name, t in zip(need[1:], (ws, xs)):
        if t.numel() != 1:
            raise UserError(f"{where}: {name} has {t.numel()} values; FP8 (per tensor) has one "
                            f"(FP8_PER_CHANNEL_PER_TOKEN is another algorithm).")
    return w.view(torch.float8_e4m3fn), ws.float().reshape(()), xs.float().reshape(())


ROW_PARALLEL = ("attention.dense", "mlp.proj")  # their inputs are split across ranks


def store_quantized(tensors: dict[str, torch.Tensor], quant: Optional[Quantization], num_layers: int,
                    dtype: torch.dtype, calib: Optional[dict[str, dict[str, torch.Tensor]]] = None, tp_size: int = 1,
                    rank: int = 0) -> dict[str, torch.Tensor]:
    """A rank's float base tensors -> the form its checkpoint stores: W4A16_AWQ and FP8 layers quantized, every other
    algorithm's weights left in float (TensorRT-LLM's build and this backend's load quantize them).
    `calib`: per module (TensorRT-LLM name) the calibration's results over its full, unsharded layer
    (`checkpoint/calibration.py`): AWQ's input scales "smooth" [in] (sliced here for row-parallel layers; groups never
    straddle ranks, so every rank's int4 values and scales are those of TP 1), or FP8's "weight_amax" and
    "input_amax" (per tensor: every rank shares them)."""
    if quant is None or not quant.stored_quantized:
        return tensors
    modules = [f"transformer.layers.{i}.{m}" for i in range(num_layers) for m in LAYER_LINEARS] + ["lm_head"]
    out = dict(tensors)
    for module in modules:
        if quant.quantizes(module) and module + ".weight" in out:
            w = out.pop(module + ".weight")
            found = (calib or {}).get(module, {})
            if quant.fp8:
                if "input_amax" not in found:
                    raise UserError(f"FP8 needs calibrated input scales and none were made for {module}: give "
                                    f"--calib-prompts FILE.jsonl (or magpie).")
                parts = fp8_tensors(w, float(found["weight_amax"]), float(found["input_amax"]))
            else:
                s = found.get("smooth")
                if s is not None and module.endswith(ROW_PARALLEL) and tp_size > 1:
                    s = s.chunk(tp_size)[rank]
                parts = awq_tensors(w, quant.group_size, dtype, s)
            out.update({f"{module}.{k}": v for k, v in parts.items()})
    return out


def dequantize_stored(tensors: dict[str, torch.Tensor], quant: Quantization, dtype: torch.dtype,
                      where: str) -> dict[str, torch.Tensor]:
    """A rank's W4A16_AWQ or FP8 tensors -> the float weights they stand for (AWQ's input scale folded into the
    weight's columns; FP8's input quantization dropped), under the plain names, so that they unshard like any float
    base. For what needs the base's values but not its exact quantized arithmetic (the model N-gram table)."""
    out = {k: v for k, v in tensors.items() if not k.endswith(("scaling_factor",))}
    for name in [k for k in tensors if k.endswith(".weight")]:
        module = name[:-len(".weight")]
        if module + ".weights_scaling_factor" not in tensors:
            continue
        if quant.fp8:
            w8, ws, _ = read_fp8(tensors, module, where)
            w = w8.float() * ws
        else:
            q, scales, pre = read_awq(tensors, module, quant.group_size, where)
            w = dequantize_groups(q, scales, quant.group_size)
            if pre is not None:
                w = w * pre.float()[None, :]
        out[name] = w.to(dtype)
    return out
