"""`trt-redrafter convert`: HF Llama/Vicuna (or a TensorRT-LLM LLaMA checkpoint) + Apple drafter -> ReDrafter
TensorRT-LLM checkpoint. Thin: flags and recipe in, `checkpoint.convert` does the work."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..checkpoint.convert import DEFAULT_DTYPE, ConvertConfig, convert_base_checkpoint, convert_checkpoint
from ..checkpoint.quantization import CALIBRATED, MODES
from ..config import ReDrafterConfig, load_recipe
from ..errors import UserError
from ..log import get_logger

logger = get_logger(__name__)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "convert", help="convert a Llama/Vicuna base + Apple drafter to a TP-sharded TensorRT-LLM ReDrafter checkpoint",
        description="Write config.json + rank{r}.safetensors exactly as TensorRT-LLM's ReDrafter converter does. "
                    "Recipe values (--config) are defaults; flags override them.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--base-model", type=Path, help="Hugging Face Llama/Vicuna directory (one-step form)")
    src.add_argument("--base-checkpoint", type=Path,
                     help="TensorRT-LLM LLaMA checkpoint directory (two-step form: its tensors are copied unchanged)")
    p.add_argument("--drafter", type=Path, help="Apple-format drafter directory (config.json + model.safetensors)")
    p.add_argument("--output", type=Path, required=True, help="checkpoint directory to create")
    p.add_argument("--config", type=Path, help="build recipe (YAML), e.g. builders/vicuna-7b.yaml")
    p.add_argument("--force", action="store_true", help="replace an existing output directory")
    p.add_argument("--base-only", action="store_true",
                   help="write only the plain TensorRT-LLM LLaMA checkpoint of --base-model (two-step input)")
    ConvertConfig.add_cli_args(p)
    ReDrafterConfig.add_cli_args(p)
    p.set_defaults(func=run)


CALIB_MAGPIE = 32  # user prompts the base writes itself when int4_awq or fp8 has no --calib-prompts
CALIBRATED_MODES = tuple(mode for mode, (algo, _) in MODES.items() if algo in CALIBRATED)  # int4_awq, fp8


def calibration_ids(opts: ConvertConfig, base_model: Path | None) -> list[list[int]] | None:
    """Token ids of the calibration prompts in the base's chat template (int4_awq or fp8 from a Hugging Face base),
    or None (AWQ: no search; FP8 refuses that, checkpoint/convert.py)."""
    if opts.quantize not in CALIBRATED_MODES or base_model is None or opts.calib_prompts == "none":
        return None
    import torch
    from transformers import AutoTokenizer

    from ..chat import chat_ids, chat_prompt_ids, has_chat_template

    tok = AutoTokenizer.from_pretrained(str(base_model))
    if opts.calib_prompts in (None, "magpie"):
        from transformers import AutoModelForCausalLM

        from ..training.prompts import hf_sampler, magpie_user_prompts
        if not has_chat_template(tok):
            logger.warning("the base has no chat template to write its own calibration prompts; give "
                           "--calib-prompts FILE.jsonl")
            return None
        model = AutoModelForCausalLM.from_pretrained(str(base_model), dtype=torch.float32).eval()
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        texts = magpie_user_prompts(hf_sampler(model, torch.device("cpu"), pad), tok, CALIB_MAGPIE, seed=0)
        logger.info("calibration: %d user prompts written by the base itself (Magpie)", len(texts))
    else:
        from ..training.prompts import read_conversations
        convs = read_conversations(opts.calib_prompts, "--calib-prompts: {path} does not exist.")
        if has_chat_template(tok):
            return [chat_ids(tok, c) for c in convs]
        texts = [c[-1]["content"] for c in convs]
    return [chat_prompt_ids(tok, t) if has_chat_template(tok) else tok(t)["input_ids"] for t in texts]


def run(args: argparse.Namespace) -> int:
    recipe = load_recipe(args.config) if args.config else None
    opts = ConvertConfig.from_sources(recipe, args)
    if args.base_only:
        if args.base_model is None:
            raise UserError("--base-only needs --base-model (it writes the plain LLaMA checkpoint of an HF model).")
        convert_base_checkpoint(args.base_model, args.output, tp=opts.tp or 1, dtype=opts.dtype or DEFAULT_DTYPE,
                                workers=opts.workers, force=args.force, quantize=opts.quantize,
                                quantize_lm_head=opts.quantize_lm_head, group_size=opts.group_size,
                                calibrate=lambda: calibration_ids(opts, args.base_model))
        return 0
    if args.drafter is None:
        raise UserError("--drafter is required: the Apple-format drafter directory to attach to the base model.")
    redrafter = ReDrafterConfig.from_sources(recipe, args)
    convert_checkpoint(args.drafter, args.output, opts, redrafter, base_model=args.base_model,
                       base_checkpoint=args.base_checkpoint, force=args.force,
                       recipe_model=(recipe or {}).get("model"), recipe_where=str(args.config or ""),
                       calibrate=lambda: calibration_ids(opts, args.base_model))
    return 0
