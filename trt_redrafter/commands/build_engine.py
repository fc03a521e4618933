"""`build-engine`: a TensorRT-LLM ReDrafter checkpoint (or an HF base + drafter, converted on the way) -> engine dir.

Without a drafter (an HF base alone, or a plain TensorRT-LLM LLaMA checkpoint) the torch backend builds an engine
that speculates with the learning-free N-gram proposer (--proposer ngram; tree shape from --num-beams and
--draft-len-per-beam); the trtllm backend builds TensorRT-LLM's auto-regressive engine from it (the AR baseline)."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from ..backends import BACKENDS, default_backend, trtllm_available
from ..checkpoint.convert import DEFAULT_DTYPE, ConvertConfig, convert_base_checkpoint, convert_checkpoint
from .convert import calibration_ids
from ..config import BuildConfig, ProposerConfig, ReDrafterConfig, load_recipe
from ..errors import UserError
from ..log import get_logger

logger = get_logger(__name__)


def register(sub) -> None:
    p = sub.add_parser("build-engine", help="build an engine from a ReDrafter checkpoint",
                       description="Build an engine dir from a TensorRT-LLM ReDrafter checkpoint (--checkpoint), "
                                   "or convert an HF base + Apple drafter first (--base-model + --drafter).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="TensorRT-LLM ReDrafter checkpoint dir (trt-redrafter convert)")
    src.add_argument("--base-model", help="HF Llama/Vicuna dir (one-shot: convert, then build)")
    p.add_argument("--drafter", help="Apple-format drafter dir (with --base-model; without one the engine drafts "
                                     "with N-grams)")
    p.add_argument("--output", required=True, help="engine directory to write")
    p.add_argument("--tp", type=int, help="tensor-parallel size (must match the checkpoint)")
    p.add_argument("--backend", choices=BACKENDS, help="default: trtllm where tensorrt_llm imports, else torch")
    p.add_argument("--config", help="build recipe (builders/*.yaml); flags override it")
    p.add_argument("--tokenizer", help="tokenizer dir to bundle (default with --base-model: the base model dir)")
    p.add_argument("--workers", type=int, default=1, help="ranks converted/built in parallel")
    p.add_argument("--force", action="store_true", help="replace an existing output directory")
    BuildConfig.add_cli_args(p)
    ProposerConfig.add_cli_args(p.add_argument_group("proposers (torch backend; runtime/ngram.py)"))
    g = p.add_argument_group("conversion (with --base-model); the tree shape of an engine without a drafter")
    ReDrafterConfig.add_cli_args(g)
    ConvertConfig.add_cli_args(g, only=("trtllm_format", "quantize", "quantize_lm_head", "group_size",
                                        "calib_prompts"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    recipe = load_recipe(args.config) if args.config else None
    build = BuildConfig.from_sources(recipe, args)
    backend = args.backend or default_backend()
    if args.backend is None and backend == "torch":
        logger.info("tensorrt_llm is not importable here; building for the torch backend")
    if backend == "trtllm" and not trtllm_available():
        from ..backends.trtllm import require_trtllm

        require_trtllm()  # one sentence naming what to install
    if args.tp is not None and args.tp <= 0:
        raise UserError(f"--tp must be a positive integer, got {args.tp}.")
    out = Path(args.output)
    if out.exists() and not args.force:
        raise UserError(f"engine directory {out} already exists; pass --force to replace it or choose another path.")
    if args.drafter and not args.base_model:
        raise UserError("--drafter goes with --base-model (a --checkpoint already holds its drafter, if any).")
    if args.base_model:
        with tempfile.TemporaryDirectory(prefix=".ckpt-", dir=out.absolute().parent) as tmp:
            ckpt = Path(tmp) / "checkpoint"
            _convert(args, recipe, ckpt)
            _build(backend, ckpt, out, build, args, recipe, tokenizer=args.tokenizer or args.base_model)
    else:
        _build(backend, Path(args.checkpoint), out, build, args, recipe, tokenizer=args.tokenizer)
    print(f"engine written to {out}")
    return 0


def _convert(args, recipe, ckpt: Path) -> None:
    """--base-model (+ --drafter) -> a ReDrafter checkpoint, or without a drafter a plain LLaMA one."""
    # build-engine's own --tp, --dtype and --workers are the conversion's too
    opts = ConvertConfig.from_sources(recipe, args, flags={"tp": args.tp, "dtype": args.dtype, "workers": args.workers})
    if not args.drafter:
        convert_base_checkpoint(args.base_model, ckpt, tp=opts.tp or 1, dtype=opts.dtype or DEFAULT_DTYPE,
                                workers=opts.workers, quantize=opts.quantize, quantize_lm_head=opts.quantize_lm_head,
                                group_size=opts.group_size, calibrate=lambda: calibration_ids(opts, Path(args.base_model)))
        return
    convert_checkpoint(args.drafter, ckpt, opts, ReDrafterConfig.from_sources(recipe, args), base_model=args.base_model,
                       recipe_model=(recipe or {}).get("model"), recipe_where=str(args.config or ""),
                       calibrate=lambda: calibration_ids(opts, Path(args.base_model)))


def _tree_flags(recipe, args) -> ReDrafterConfig | None:
    """The tree shape the user asked for, or None (a ReDrafter checkpoint then keeps its own)."""
    asked = (recipe or {}).get(ReDrafterConfig.SECTION) or any(
        getattr(args, n, None) is not None for n in ("num_beams", "draft_len_per_beam"))
    return ReDrafterConfig.from_sources(recipe, args) if asked else None


def _build(backend: str, ckpt: Path, out: Path, build: BuildConfig, args, recipe, tokenizer) -> None:
    if backend == "trtllm":
        from ..backends.trtllm import build_trtllm_engine
        build_trtllm_engine(ckpt, out, build, args.tp, tokenizer_dir=tokenizer, force=args.force,
                            workers=args.workers)
    else:
        from ..backends.torch_build import build_torch_engine
        build_torch_engine(ckpt, out, build, args.tp, tokenizer_dir=tokenizer, force=args.force,
                           tree=_tree_flags(recipe, args), proposer=ProposerConfig.from_sources(recipe, args))
