"""`trt-redrafter train-drafter`: distil an Apple-format ReDrafter drafter from an HF Llama base. Thin over
`training.loop`."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..training.config import DrafterTrainConfig
from ..training.loop import train_drafter


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "train-drafter", help="distil an Apple-format drafter from an HF Llama base (self-distillation)",
        description="The frozen base answers prompts greedily (text windows, a JSONL of prompts or conversations, "
                    "or prompts it writes itself with --magpie); the drafter learns the base's own next-token "
                    "predictions on them (summed cross-entropy over --draft-len steps). The corpus (hidden states "
                    "in shards) and checkpoints live in --work-dir, so an interrupted run continues with --resume. "
                    "Under torchrun each process trains on its slice of every batch (DDP). Writes "
                    "OUTPUT/config.json, model.safetensors (Apple names) and training.json.")
    p.add_argument("--base-model", type=Path, required=True, help="HF Llama directory (with tokenizer)")
    p.add_argument("--output", type=Path, required=True, help="drafter directory to create")
    p.add_argument("--force", action="store_true", help="replace an existing output directory")
    DrafterTrainConfig.add_cli_args(p)  # every training setting: its flag, help and default from the config
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cfg = DrafterTrainConfig.from_sources(None, args)
    s = train_drafter(args.base_model, args.output, cfg, force=args.force)
    if "stopped_at" in s:
        print(f"stopped after step {s['stopped_at']}; checkpoint {s['checkpoint']} (continue with --resume)")
        return 0
    if not s:  # a torchrun process other than rank 0
        return 0
    held = s["held_out"]
    print(f"wrote {args.output}: final loss {s['final_loss']}, held-out top-1 per step "
          f"{' '.join(f'{a:.3f}' for a in held['top1'])} (1-beam expected tokens/step "
          f"{held['expected_tokens_per_step_1beam']})")
    return 0
