"""`trt-redrafter import-gguf`: a Llama, Qwen2 or Qwen3 GGUF (llama.cpp's format) -> a plain Hugging Face directory, the input
`convert` and `train-drafter` take. Thin over `checkpoint.gguf_import`."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..checkpoint.gguf_import import DEFAULT_DTYPE, import_gguf
from ..config import DTYPES


def register(subparsers) -> None:
    p = subparsers.add_parser("import-gguf", help="write a Llama / Qwen2 / Qwen3 GGUF as a Hugging Face directory",
                              description="Dequantizes the GGUF with transformers and writes config.json, "
                                          "generation_config.json, model.safetensors and the tokenizer (with its chat "
                                          "template). Needs the `gguf` extra: pip install 'trt-redrafter[gguf]'.")
    p.add_argument("--gguf", type=Path, required=True, help="the .gguf file (general.architecture llama, qwen2 or qwen3)")
    p.add_argument("--output", type=Path, required=True, help="Hugging Face directory to create")
    p.add_argument("--dtype", choices=DTYPES, default=DEFAULT_DTYPE,
                   help=f"weight dtype of the written model (default {DEFAULT_DTYPE}: dequantized values kept exactly)")
    p.add_argument("--force", action="store_true", help="replace an existing output directory")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import_gguf(args.gguf, args.output, dtype=args.dtype, force=args.force)
    return 0
