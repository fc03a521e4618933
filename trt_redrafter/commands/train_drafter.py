"""`trt-redrafter train-drafter`: distil an Apple-format ReDrafter drafter from an HF Llama base. Thin over
`training.drafter_training`."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..training.drafter_training import DrafterTrainConfig, train_drafter
from ..training.generation import GENERATORS

_D = DrafterTrainConfig()


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
    p.add_argument("--draft-len", type=int, default=_D.draft_len, help="drafter steps trained (T)")
    p.add_argument("--num-layers", type=int, default=_D.num_layers, help="ResBlocks")
    p.add_argument("--rnn", action=argparse.BooleanOptionalAction, default=_D.rnn, help="recurrent state")
    p.add_argument("--exit-dim", type=int, default=_D.exit_dim,
                   help="ResBlock width; 2*hidden has no input projection (Apple's recipe); 0 (default): 2*hidden "
                        "unless the drafter's vocabulary head would cost more than a quarter of the base's weights per "
                        "step, else the widest power of two that fits, behind an input projection")
    p.add_argument("--draft-vocab", type=int, default=_D.draft_vocab, metavar="K",
                   help="0 (default): the drafter's head scores the whole vocabulary (Apple's and TensorRT-LLM's "
                        "format); K: only the K tokens the base generates most often in the corpus (FR-Spec), a "
                        "head V/K times cheaper per drafted token; outputs do not change (verification is exact), "
                        "but only --backend torch runs such a drafter")
    p.add_argument("--steps", type=int, default=_D.steps, help="optimizer steps")
    p.add_argument("--lr", type=float, default=_D.lr, help="peak learning rate (AdamW, warmup + cosine)")
    p.add_argument("--weight-decay", type=float, default=_D.weight_decay, help="AdamW weight decay")
    p.add_argument("--soft-targets", type=float, default=_D.soft_targets, metavar="W",
                   help="weight in [0, 1] of the base's whole next-token distribution in each step's loss "
                        "(knowledge distillation; 0: its greedy token only, Apple's recipe)")
    p.add_argument("--batch-size", type=int, default=_D.batch_size, help="drafting positions per step")
    p.add_argument("--seq-len", type=int, default=_D.seq_len, help="tokens the base generates per sequence")
    p.add_argument("--num-sequences", type=int, default=_D.num_sequences, help="distillation sequences")
    p.add_argument("--eval-sequences", type=int, default=_D.eval_sequences, help="held-out sequences")
    p.add_argument("--prompt-min", type=int, default=_D.prompt_min, help="shortest prompt window (tokens)")
    p.add_argument("--prompt-max", type=int, default=_D.prompt_max, help="longest prompt window (tokens)")
    p.add_argument("--gen-batch-size", type=int, default=_D.gen_batch_size,
                   help="sequences per corpus shard, and the corpus engine's batch (hf: per generate call)")
    p.add_argument("--seed", type=int, default=_D.seed)
    p.add_argument("--data", default=None,
                   help="text: 'stdlib' (default: the Python standard library), a directory of *.py/*.txt/*.md "
                        "files, or one text file")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompts", help="JSONL of prompts or conversations ({\"prompt\"}, MT-Bench {\"turns\"}, "
                                       "{\"messages\"} or ShareGPT {\"conversations\"}); the chat template is applied "
                                       "and a quarter at most (--eval-sequences) is held out")
    src.add_argument("--magpie", action="store_true",
                     help="the base writes its own user prompts (its chat template's user-turn prefix, sampled), "
                          "then answers them")
    p.add_argument("--work-dir", help="corpus shards and checkpoints (default: OUTPUT.work); a corpus made with the "
                                      "same settings is reused")
    p.add_argument("--save-every", type=int, default=_D.save_every, help="checkpoint every N steps")
    p.add_argument("--resume", action="store_true", help="continue from the work directory's checkpoint")
    p.add_argument("--stop-after", type=int, default=0,
                   help="end this run after N steps, leaving a checkpoint to --resume from")
    p.add_argument("--shards-in-memory", type=int, default=_D.shards_in_memory,
                   help="corpus shards (of --gen-batch-size sequences) held in memory while training")
    p.add_argument("--dtype", default=_D.dtype, choices=("float32", "bfloat16", "float16"),
                   help="dtype of the written weights")
    p.add_argument("--generator", default=_D.generator, choices=GENERATORS,
                   help="who writes the corpus: engine (default: the project's torch engine, --gen-batch-size "
                        "requests batched in flight, hidden states recorded by the decode step) or hf (HF generate, "
                        "one batch per shard)")
    p.add_argument("--generate-dtype", default=_D.generate_dtype, choices=("float32", "bfloat16", "float16"),
                   help="the base's dtype while it writes the corpus (bfloat16 is faster on CPUs with AVX512-BF16; "
                        "match the dtype you will deploy)")
    p.add_argument("--device", default=_D.device, choices=("auto", "cpu", "cuda"))
    p.add_argument("--threads", type=int, default=_D.threads, help="torch CPU threads (0: torch's default)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cfg = DrafterTrainConfig(
        draft_len=args.draft_len, num_layers=args.num_layers, rnn=args.rnn, exit_dim=args.exit_dim,
        draft_vocab=args.draft_vocab, steps=args.steps,
        lr=args.lr, weight_decay=args.weight_decay, soft_targets=args.soft_targets, batch_size=args.batch_size,
        seq_len=args.seq_len, num_sequences=args.num_sequences,
        eval_sequences=args.eval_sequences, prompt_min=args.prompt_min, prompt_max=args.prompt_max,
        gen_batch_size=args.gen_batch_size, seed=args.seed, data=args.data, device=args.device,
        threads=args.threads, prompts=args.prompts, magpie=args.magpie, work_dir=args.work_dir,
        save_every=args.save_every, resume=args.resume, stop_after=args.stop_after,
        shards_in_memory=args.shards_in_memory, dtype=args.dtype, generator=args.generator,
        generate_dtype=args.generate_dtype)
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
