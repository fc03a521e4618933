"""`trt-redrafter make-tiny`: write a tiny random HF Llama + Apple drafter pair for tests. Thin over
`checkpoint.tiny`."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..checkpoint.tiny import TinyConfig, make_tiny
from ..config import load_recipe


def register(subparsers) -> None:
    p = subparsers.add_parser("make-tiny", help="write a tiny random Llama (HF) + Apple-format drafter pair",
                              description="Writes DIR/base (HF Llama + tokenizer) and DIR/drafter. Same seed and "
                                          "sizes give byte-identical weights.")
    p.add_argument("--output", type=Path, required=True, help="directory to create")
    p.add_argument("--config", type=Path, help="recipe whose make_tiny: section gives the sizes (flags override)")
    p.add_argument("--force", action="store_true", help="replace an existing output directory")
    TinyConfig.add_cli_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    recipe = load_recipe(args.config) if args.config else None
    make_tiny(args.output, TinyConfig.from_sources(recipe, args), force=args.force)
    return 0
