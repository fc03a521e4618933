"""Calibration for the quantized bases `convert --quantize` writes with scales from data: the float model (Hugging
Face's, fp32) is run over calibration prompts with hooks on its linear layers' inputs, and each algorithm reduces what
they saw.

- `int4_awq`: AWQ's input-channel scales (checkpoint/awq.py), from up to `awq.MAX_ROWS` input rows per layer.
- `fp8`: each layer's input amax over every calibration token, and its weight amax over the whole (unsharded) layer,
  from which the checkpoint's per-tensor scales are amax / 448 (quantization.fp8_tensors), as ModelOpt's max
  calibration exports them for TensorRT-LLM (modelopt/torch/export/quant_utils.py `get_scaling_factor`). q, k and v
  take one weight scale, the max of theirs (ModelOpt fuses them before export: `preprocess_linear_fusion` in
  `build_qkv`, model_config_utils); mlp.fc and mlp.gate keep their own, which TensorRT-LLM's build merges when it
  fuses them (models/modeling_utils.py `fuse_gate_mlp` @27712aa7: the max of both, weights requantized), as the torch
  backend does at load (model/linear.py `Fp8Weight.cat`).

Results are keyed by TensorRT-LLM module name (transformer.layers.{i}.attention.qkv, ..., lm_head):
{"smooth": s [in]} for AWQ, {"weight_amax", "input_amax"} (fp32 scalars) for FP8.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from ..log import get_logger
from .awq import MAX_ROWS, best_scale
from .quantization import Quantization

log = get_logger(__name__)

# per decoder layer: the HF module whose input is recorded, and the TensorRT-LLM modules that read that input with
# the HF weights each is made of (in order)
LAYER_GROUPS: tuple[tuple[str, dict[str, tuple[str, ...]]], ...] = (
    ("self_attn.q_proj", {"attention.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")}),
    ("self_attn.o_proj", {"attention.dense": ("self_attn.o_proj",)}),
    ("mlp.gate_proj", {"mlp.fc": ("mlp.gate_proj",), "mlp.gate": ("mlp.up_proj",)}),
    ("mlp.down_proj", {"mlp.proj": ("mlp.down_proj",)}),
)


def run_hooked(model: torch.nn.Module, calib_ids: list[list[int]], inputs: dict[str, torch.nn.Module],
               record: Callable[[str, torch.Tensor], None]) -> None:
    """Run `model` over each prompt, calling record(key, rows [n, in]) with the input of each module in `inputs`."""
    def hook(key: str):
        return lambda _m, args: record(key, args[0].reshape(-1, args[0].shape[-1]))

    hooks = [mod.register_forward_pre_hook(hook(key)) for key, mod in inputs.items()]
    try:
        device = next(model.parameters()).device
        with torch.inference_mode():
            for ids in calib_ids:
                model(torch.tensor([ids], device=device))
    finally:
        for h in hooks:
            h.remove()


def _layer_inputs(layers) -> dict[str, torch.nn.Module]:
    """"{layer}.{HF module}" -> the module whose input each LAYER_GROUPS entry records."""
    return {f"{i}.{hf_in}": layer.get_submodule(hf_in) for i, layer in enumerate(layers) for hf_in, _ in LAYER_GROUPS}


def _amax(weights: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([w.detach().float().abs().amax() for w in weights]).amax()


def fp8_amax(model: torch.nn.Module, calib_ids: list[list[int]], num_layers: int,
             lm_head: bool) -> dict[str, dict[str, torch.Tensor]]:
    """FP8's weight and input amax per TensorRT-LLM module (module docstring)."""
    layers = model.model.layers[:num_layers]
    inputs = _layer_inputs(layers)
    if lm_head:
        inputs["lm_head"] = model.lm_head
    seen: dict[str, torch.Tensor] = {}

    def record(key: str, rows: torch.Tensor) -> None:
        a = rows.detach().float().abs().amax()
        seen[key] = a if key not in seen else torch.maximum(seen[key], a)

    run_hooked(model, calib_ids, inputs, record)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for i, layer in enumerate(layers):
        for hf_in, modules in LAYER_GROUPS:
            for trt_name, hf_weights in modules.items():
                out[f"transformer.layers.{i}.{trt_name}"] = {
                    "weight_amax": _amax([layer.get_submodule(n).weight for n in hf_weights]),
                    "input_amax": seen[f"{i}.{hf_in}"]}
    if lm_head:
        out["lm_head"] = {"weight_amax": _amax([model.lm_head.weight]), "input_amax": seen["lm_head"]}
    log.info("FP8 scales from %d calibration prompts: input amax %.3g-%.3g over %d layers", len(calib_ids),
             min(float(v["input_amax"]) for v in out.values()), max(float(v["input_amax"]) for v in out.values()),
             len(out))
    return out


def awq_scales(model: torch.nn.Module, calib_ids: list[list[int]], group_size: int,
               num_layers: int) -> dict[str, torch.Tensor]:
    """AWQ's input scales (checkpoint/awq.py) per TensorRT-LLM module (transformer.layers.{i}.X): s [in] over the
    full (unsharded) input; layers that read one input share one."""
    layers = model.model.layers[:num_layers]
    inputs = _layer_inputs(layers)
    seen: dict[str, list[torch.Tensor]] = {}

    def record(key: str, rows: torch.Tensor) -> None:
        have = sum(r.shape[0] for r in seen.get(key, []))
        if have < MAX_ROWS:
            seen.setdefault(key, []).append(rows[:MAX_ROWS - have].detach().clone())

    run_hooked(model, calib_ids, inputs, record)
    out: dict[str, torch.Tensor] = {}
    alphas = []
    for i, layer in enumerate(layers):
        for hf_in, modules in LAYER_GROUPS:
            x = torch.cat(seen[f"{i}.{hf_in}"])
            hf_weights = [n for names in modules.values() for n in names]
            s, alpha = best_scale(x, [layer.get_submodule(n).weight.detach() for n in hf_weights], group_size)
            alphas.append(alpha)
            for name in modules:
                out[f"transformer.layers.{i}.{name}"] = s
    log.info("AWQ scales from %d calibration prompts (%d token rows per layer at most): mean alpha %.2f, %d of %d "
             "layer groups keep s = 1", len(calib_ids), MAX_ROWS, sum(alphas) / len(alphas),
             sum(a == 0 for a in alphas), len(alphas))
    return out


def calibrate(model_dir: str | Path, calib_ids: list[list[int]], quant: Quantization,
              num_layers: int) -> dict[str, dict[str, torch.Tensor]]:
    """The calibration results `quantization.store_quantized` takes, for an AWQ or FP8 `quant`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if quant.fp8:
        return fp8_amax(model, calib_ids, num_layers, quant.quantizes("lm_head"))
    return {name: {"smooth": s} for name, s in awq_scales(model, calib_ids, quant.group_size, num_layers).items()}
