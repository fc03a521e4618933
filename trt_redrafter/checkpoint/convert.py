"""Convert a Llama/Vicuna base + Apple drafter into a TensorRT-LLM ReDrafter checkpoint, sharded for TP.

Two entry points, matching TensorRT-LLM's two converters (reference/trtllm-redrafter.md §1.2, §8):
- one step: HF base directory + drafter -> `config.json` + `rank{r}.safetensors` (`convert_checkpoint`);
- two step: an existing TensorRT-LLM LLaMA checkpoint + drafter -> every base tensor of rank r copied unchanged,
  `drafter.*` added (`convert_checkpoint(base_checkpoint=...)`); `convert_base_checkpoint` writes such a base.

Everything the user can get wrong is checked before anything is written, and output goes through
`atomic_output_dir`, so a refused or failed run leaves no directory behind. Ranks are written in parallel
(`workers` threads); each rank reads the full HF tensors lazily and keeps only its slice.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar, Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from ..config import DTYPES, ConfigBase, DrafterConfig, ModelConfig, ReDrafterConfig, option, torch_dtype
from ..errors import UserError
from ..fsutil import atomic_output_dir
from ..log import get_logger
from . import sharding
from .drafter import DrafterCheckpoint, read_drafter
from .hf import HFCheckpoint, read_hf_model
from .quantization import GROUP_SIZES, MODES, check_group_size, parse_quantization, store_quantized
from .sharding import Mapping
from .trtllm_config import (FORMATS, add_redrafter_keys, base_pretrained_config, build_pretrained_config,
                            read_trtllm_checkpoint, write_config)

log = get_logger(__name__)

DEFAULT_DTYPE = "float16"  # TensorRT-LLM's converters default to fp16
# calibration prompts (int4_awq, fp8) as token ids, made only when they are needed (commands/convert.py calibration_ids)
Calibration = Callable[[], Optional[list[list[int]]]]


@dataclass
class ConvertConfig(ConfigBase):
    """How to write the checkpoint (recipe section `convert:`; flags --tp, --dtype, --trtllm-format, --workers)."""

    SECTION: ClassVar[str] = "convert"

    tp: Optional[int] = option(None, help="tensor-parallel size (default: the base checkpoint's TP in the two-step "
                                      "form, else 1)")
    dtype: Optional[str] = option(None, help="weight dtype: float16, bfloat16 or float32 (default: the base "
                                         "checkpoint's dtype in the two-step form, else float16)")
    trtllm_format: str = option("1.x", help="1.x: ReDrafterForLLaMALM (TensorRT-LLM 1.0-1.2); legacy: "
                                        "ReDrafterForCausalLM (TensorRT-LLM 0.12-0.21)", choices=FORMATS)
    workers: int = option(1, help="ranks converted in parallel")
    quantize: Optional[str] = option(None, help="quantized base, in TensorRT-LLM's forms: int8_wo / int4_wo (W8A16 / "
                                            "W4A16, one scale per output channel; weights stay float in the "
                                            "checkpoint, as TensorRT-LLM's quantize.py writes them, and are quantized "
                                            "when the engine is built or loaded), int4_awq (W4A16_AWQ, per-group "
                                            "scales, AWQ-calibrated) or fp8 (FP8: e4m3 weights and inputs, "
                                            "per-tensor scales calibrated on --calib-prompts); the drafter stays "
                                            "float",
                                     choices=tuple(MODES))
    quantize_lm_head: bool = option(False, help="with --quantize: quantize the base's lm_head too (the torch "
                                                "backend runs it; TensorRT-LLM's weight-only build leaves lm_head in "
                                                "float and cannot build such a checkpoint)")
    group_size: int = option(128, help="with --quantize int4_awq: inputs per scale (TensorRT-LLM's kernels: 64 or "
                                       "128; it must divide every layer's inputs per rank)", choices=GROUP_SIZES)
    calib_prompts: Optional[str] = option(None, help="with --quantize int4_awq or fp8: calibration prompts (AWQ's "
                                                     "activation-aware scales; FP8's input scales), a JSONL file "
                                                     "of prompts or conversations (the forms train-drafter --prompts "
                                                     "reads) or 'magpie' (32 user "
                                                     "prompts the base writes itself; the default); 'none' (int4_awq "
                                                     "only): round-to-nearest, no search")

    def validate(self) -> None:
        super().validate()
        s = self.SECTION
        if self.tp is not None and (not isinstance(self.tp, int) or self.tp < 1):
            raise UserError(f"{s}.tp (--tp): expected a positive integer, got {self.tp!r}.")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise UserError(f"{s}.dtype (--dtype): expected one of {', '.join(DTYPES)}, got {self.dtype!r}.")
        if not isinstance(self.workers, int) or self.workers < 1:
            raise UserError(f"{s}.workers (--workers): expected a positive integer, got {self.workers!r}.")
        if self.quantize == "fp8" and self.calib_prompts == "none":
            raise UserError(f"{s}.calib_prompts (--calib-prompts) none: fp8 needs calibration prompts for its input "
                            f"scales; give a JSONL file or leave it unset (magpie).")
        if self.quantize_lm_head and self.quantize is None:
            raise UserError(f"{s}.quantize_lm_head (--quantize-lm-head) needs --quantize.")


# ---- checks shared by both forms -----------------------------------------------------------------------------

def check_recipe_model(expected: dict | None, model: ModelConfig, where: str) -> None:
    """Refuse a base model whose dimensions differ from the recipe's `model:` section."""
    if not expected:
        return
    if not isinstance(expected, dict):
        raise UserError(f"{where}: section 'model' must be a mapping.")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(expected) - fields)
    if unknown:
        raise UserError(f"{where}: unknown model key(s) {', '.join(unknown)}; known: {', '.join(sorted(fields))}.")
    for k, v in expected.items():
        if k == "dtype":  # the recipe's convert.dtype decides the output dtype
            continue
        got = getattr(model, k)
        if got != v and not (isinstance(v, (int, float)) and isinstance(got, (int, float)) and float(got) == v):
            raise UserError(f"the base model has {k}={got!r} but recipe {where} expects {v!r}; "
                            f"use the recipe that matches this model.")


def check_pair(model: ModelConfig, drafter: DrafterConfig, drafter_path: Path) -> None:
    """The drafter must have been trained on this base: same hidden size and vocabulary."""
    if drafter.hidden_size != model.hidden_size:
        raise UserError(f"drafter {drafter_path} has hidden_size={drafter.hidden_size} but the base model has "
                        f"hidden_size={model.hidden_size}; use the drafter trained for this base model.")
    if drafter.vocab_size != model.vocab_size:
        raise UserError(f"drafter {drafter_path} has vocab_size={drafter.vocab_size} but the base model has "
                        f"vocab_size={model.vocab_size}; use the drafter trained for this base model.")


def _refuse_existing(output: Path, force: bool) -> None:
    if output.exists() and not force:
        raise UserError(f"output directory {output} already exists; pass --force to replace it or choose another "
                        f"path.")


def _caster(dtype: str) -> Callable[[torch.Tensor], torch.Tensor]:
    td = torch_dtype(dtype)
    return lambda t: t.to(td).contiguous()


def _write_ranks(out: Path, tp: int, workers: int, make_rank: Callable[[Mapping], dict[str, torch.Tensor]]) -> None:
    """Write rank{r}.safetensors for every rank, `workers` at a time (no metadata, as TensorRT-LLM writes them)."""
    def job(r: int) -> int:
        tensors = make_rank(Mapping(tp, r))
        save_file(tensors, str(out / f"rank{r}.safetensors"))
        return r

    with ThreadPoolExecutor(max_workers=min(workers, tp)) as pool:
        futures = [pool.submit(job, r) for r in range(tp)]
        for fut in tqdm(as_completed(futures), total=tp, desc="ranks", unit="rank", disable=None):
            fut.result()


def _base_rank(hf: HFCheckpoint, cast, m: Mapping, config: dict,
               calib: Optional[dict[str, dict[str, torch.Tensor]]] = None) -> dict[str, torch.Tensor]:
    """One rank's base tensors as the checkpoint stores them (`config`'s quantization applied where stored; `calib`:
    the calibration's scales, checkpoint/calibration.py)."""
    tensors = sharding.shard_base(hf.get, hf.config, m, cast)
    return store_quantized(tensors, parse_quantization(config, "config.json"), hf.config.num_hidden_layers,
                           torch_dtype(hf.config.dtype), calib, m.tp_size, m.rank)


def _calibration(hf: HFCheckpoint, config: dict, tp: int, calibrate: Optional[Calibration]
                 ) -> Optional[dict[str, dict[str, torch.Tensor]]]:
    """The calibration's results for a W4A16_AWQ or FP8 config (None otherwise, or for AWQ without calibration
    prompts: round-to-nearest). AWQ's layer shapes are checked against the group size first, so a refusal comes before
    the calibration prompts are made."""
    quant = parse_quantization(config, "config.json")
    if quant is None or not quant.stored_quantized:
        return None
    if not quant.fp8:
        check_group_size(hf.config, tp, quant.group_size)
    calib_ids = calibrate() if calibrate is not None else None
    if not calib_ids:
        if quant.fp8:
            raise UserError("--quantize fp8 needs calibration prompts for its input scales: give --calib-prompts "
                            "FILE.jsonl, or leave it unset for prompts the base writes itself (Magpie; it needs a "
                            "chat template).")
        log.warning("int4_awq without calibration prompts: pre-quant scales of 1 (round-to-nearest per group of "
                    "%d); give --calib-prompts for AWQ's activation-aware scales", quant.group_size)
        return None
    from .calibration import calibrate as run_calibration
    return run_calibration(hf.path, calib_ids, quant, hf.config.num_hidden_layers)


def _open_hf(base_model: Path, dtype: str, recipe_model: dict | None, recipe_where: str) -> HFCheckpoint:
    hf = read_hf_model(base_model, dtype or DEFAULT_DTYPE)
    check_recipe_model(recipe_model, hf.config, recipe_where)
    missing = hf.missing(sharding.base_hf_names(hf.config) + ["lm_head.weight"])
    if missing:
        raise UserError(f"base model {base_model} is missing tensor(s) {', '.join(missing[:12])}"
                        f"{' ...' if len(missing) > 12 else ''}.")
    return hf


# ---- entry points ---------------------------------------------------------------------------------------------

def convert_base_checkpoint(base_model: str | Path, output: str | Path, tp: int = 1, dtype: str = DEFAULT_DTYPE,
                            workers: int = 1, force: bool = False, quantize: Optional[str] = None,
                            quantize_lm_head: bool = False, group_size: int = 128,
                            calibrate: Optional[Calibration] = None) -> Path:
    """Write a plain TensorRT-LLM LLaMA checkpoint (what TensorRT-LLM's llama converter writes, or with `quantize`
    its quantize.py --qformat int8_wo|int4_wo): the two-step input."""
    output = Path(output)
    _refuse_existing(output, force)
    hf = _open_hf(Path(base_model), dtype, None, "")
    sharding.check_tp(tp, hf.config)
    config = base_pretrained_config(hf.config, tp, "1.x", quantize, quantize_lm_head, group_size)
    cast = _caster(hf.config.dtype)
    calib = _calibration(hf, config, tp, calibrate)
    with atomic_output_dir(output, force=force, what="checkpoint") as tmp:
        write_config(tmp / "config.json", config)
        _write_ranks(tmp, tp, workers, lambda m: _base_rank(hf, cast, m, config, calib))
    log.info("wrote TensorRT-LLM %s checkpoint %s (tp=%d, %s)", hf.config.architecture, output, tp, hf.config.dtype)
    return output


def convert_checkpoint(drafter: str | Path, output: str | Path, opts: ConvertConfig, redrafter: ReDrafterConfig, *,
                       base_model: str | Path | None = None, base_checkpoint: str | Path | None = None,
                       force: bool = False, recipe_model: dict | None = None, recipe_where: str = "",
                       calibrate: Optional[Calibration] = None) -> Path:
    """Write a ReDrafter checkpoint from an HF base (`base_model`) or a TensorRT-LLM base (`base_checkpoint`)."""
    if (base_model is None) == (base_checkpoint is None):
        raise UserError("give exactly one of --base-model (Hugging Face directory) or --base-checkpoint "
                        "(TensorRT-LLM LLaMA checkpoint).")
    output = Path(output)
    _refuse_existing(output, force)
    if base_model is not None:
        hf = _open_hf(Path(base_model), opts.dtype, recipe_model, recipe_where)
        model, tp = hf.config, opts.tp or 1
    else:
        base = read_trtllm_checkpoint(base_checkpoint)
        check_recipe_model(recipe_model, base.model, recipe_where)
        model, tp = base.model, opts.tp or base.tp_size
        if tp != base.tp_size:
            raise UserError(f"--tp {tp} does not match the base checkpoint {base.path}, which was converted with "
                            f"tp_size={base.tp_size}; pass --tp {base.tp_size} or reconvert the base.")
        if opts.quantize:
            raise UserError(f"--quantize applies to a Hugging Face base (--base-model); a TensorRT-LLM base "
                            f"checkpoint keeps its own quantization ({base.path}/config.json quantization).")
        if opts.dtype and opts.dtype != model.dtype:
            raise UserError(f"--dtype {opts.dtype} does not match the base checkpoint's dtype {model.dtype} "
                            f"(TensorRT-LLM requires drafter dtype == model dtype); pass --dtype {model.dtype}.")
    d: DrafterCheckpoint = read_drafter(drafter)
    check_pair(model, d.config, d.path)
    sharding.check_tp(tp, model)
    if not sharding.drafter_splits(tp, d.config):
        d.config = d.config.replace(replicated=True)
        log.warning("--tp %d does not divide the drafter's dimensions (%s): every rank holds the whole drafter "
                    "(draft TP 1). This project's torch backend runs it; TensorRT-LLM splits the drafter and cannot "
                    "build this checkpoint.", tp, ", ".join(f"{w}={v}" for w, v, _ in sharding.drafter_needs(d.config)
                                                            if v % tp))
    cast = _caster(model.dtype)
    fmt = opts.trtllm_format

    if base_model is not None:
        config = build_pretrained_config(model, d.config, redrafter, tp, fmt, opts.quantize, opts.quantize_lm_head,
                                         opts.group_size)
        calib = _calibration(hf, config, tp, calibrate)

        def make_rank(m: Mapping) -> dict[str, torch.Tensor]:
            return {**_base_rank(hf, cast, m, config, calib), **sharding.shard_drafter(d.tensors, d.config, m, cast)}
    else:
        config = add_redrafter_keys(base.raw, d.config, redrafter, fmt)

        def make_rank(m: Mapping) -> dict[str, torch.Tensor]:
            tensors = _load_rank(base.rank_file(m.rank))
            clash = sorted(set(tensors) & ({n for n, _ in sharding.drafter_name_table(d.config)}
                                           | {sharding.DRAFTER_PREFIX + sharding.DRAFT_VOCAB}))
            if clash:
                raise UserError(f"{base.rank_file(m.rank)} already holds drafter tensor(s) {', '.join(clash)}.")
            return {**tensors, **sharding.shard_drafter(d.tensors, d.config, m, cast)}

    with atomic_output_dir(output, force=force, what="checkpoint") as tmp:
        write_config(tmp / "config.json", config)
        _write_ranks(tmp, tp, opts.workers, make_rank)
    log.info("wrote ReDrafter checkpoint %s (%s, tp=%d, %s%s, nb=%d, dl=%d)", output, config["architecture"], tp,
             model.dtype, f", base {config['quantization']['quant_algo']}" if config["quantization"].get("quant_algo")
             else "", redrafter.num_beams, redrafter.draft_len_per_beam)
    return output


def _load_rank(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path), device="cpu")
    except (OSError, SafetensorError) as e:
        raise UserError(f"cannot read base checkpoint file {path}: {e}.") from e


def read_rank_files(ckpt_dir: str | Path, tp: int) -> list[dict[str, torch.Tensor]]:
    """Every rank's tensors of a converted checkpoint (for tests and inspection tools)."""
    return [load_file(str(Path(ckpt_dir) / f"rank{r}.safetensors")) for r in range(tp)]


def unshard_checkpoint(ranks: list[dict[str, torch.Tensor]], model: ModelConfig,
                       drafter: Optional[DrafterConfig]) -> tuple[dict, dict]:
    """(full HF-named base tensors, canonical drafter tensors) rebuilt by TensorRT-LLM's sharding rules."""
    base = sharding.unshard_base(ranks, model)
    return base, (sharding.unshard_drafter(ranks, drafter) if drafter is not None else {})
