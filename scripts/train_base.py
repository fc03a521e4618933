#!/usr/bin/env python3
"""Train a small but real Llama base model (HF format) on the Python standard library's own sources.

Everything is offline: the text is the running interpreter's stdlib (`sysconfig.get_paths()['stdlib']`, top-level
`*.py` files in sorted order); a fixed list of modules is held out for evaluation (and for the drafter's held-out
prompts). Writes OUTPUT/ with config.json, model.safetensors (fp32), generation_config.json, a byte-level BPE
tokenizer that `AutoTokenizer.from_pretrained` loads, and training.json (data, sizes, steps, seed, losses).

Deterministic for a given seed, thread count and Python version (the stdlib text differs between versions).
Defaults take ~5-10 minutes on 2 CPU cores; pass bigger sizes and --device cuda on a GPU.

    python scripts/train_base.py --output models/small/base --seed 0
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trt_redrafter.errors import UserError  # noqa: E402
from trt_redrafter.fsutil import atomic_output_dir, write_json  # noqa: E402
from trt_redrafter.training.data import (HELD_OUT_MODULES, SPECIAL_TOKENS, build_tokenizer,  # noqa: E402
                                         stdlib_files, token_stream)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", type=Path, required=True, help="directory to create (HF model + tokenizer)")
    p.add_argument("--force", action="store_true", help="replace an existing output directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=800, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=256, help="training window in tokens (bos included)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (linear warmup, cosine decay)")
    p.add_argument("--warmup", type=int, default=30, help="warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--intermediate-size", type=int, default=384)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--max-position-embeddings", type=int, default=512)
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (fixed for reproducibility)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--eval-batches", type=int, default=8, help="held-out batches for the final loss")
    return p.parse_args(argv)


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def sample_batch(stream: torch.Tensor, g: torch.Generator, batch: int, seq_len: int, bos: int) -> torch.Tensor:
    """[batch, seq_len] windows: bos + seq_len-1 consecutive tokens from random offsets of the stream."""
    starts = torch.randint(0, len(stream) - seq_len, (batch,), generator=g)
    rows = [torch.cat([torch.tensor([bos]), stream[s:s + seq_len - 1]]) for s in starts.tolist()]
    return torch.stack(rows)


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    train_files, eval_files = stdlib_files()
    if not train_files or not eval_files:
        raise UserError("no Python standard-library sources found under sysconfig's stdlib path.")
    t0 = time.time()
    tokenizer = build_tokenizer(args.vocab_size, train_files)
    train = token_stream(tokenizer, train_files)
    held = token_stream(tokenizer, eval_files)
    bos = tokenizer.bos_token_id
    print(f"tokenizer: V={len(tokenizer)}; train {len(train)} tokens from {len(train_files)} files, "
          f"held-out {len(held)} tokens from {len(eval_files)} files ({time.time() - t0:.1f}s)", flush=True)

    cfg = LlamaConfig(vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                      intermediate_size=args.intermediate_size, num_hidden_layers=args.num_layers,
                      num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads,
                      max_position_embeddings=args.max_position_embeddings, rms_norm_eps=1e-6,
                      initializer_range=0.02, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                      pad_token_id=3)
    model = LlamaForCausalLM(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(args.seed)
    losses = []
    model.train()
    t_train = time.time()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        x = sample_batch(train, g, args.batch_size, args.seq_len, bos).to(device)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 25 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {loss.item():.4f}  lr {lr_at(step, args):.2e}  "
                  f"{time.time() - t_train:.0f}s", flush=True)
    train_s = time.time() - t_train

    model.eval()
    ge = torch.Generator().manual_seed(args.seed + 1)
    with torch.no_grad():
        ev = [float(model(input_ids=(x := sample_batch(held, ge, args.batch_size, args.seq_len, bos).to(device)),
                          labels=x).loss) for _ in range(args.eval_batches)]
    eval_loss = sum(ev) / len(ev)
    tail = losses[-20:]
    print(f"final train loss (mean of last {len(tail)}) {sum(tail) / len(tail):.4f}; held-out loss {eval_loss:.4f} "
          f"(ppl {math.exp(eval_loss):.1f}); {train_s:.0f}s", flush=True)

    model = model.to("cpu", torch.float32)
    model.generation_config.bos_token_id, model.generation_config.eos_token_id = 1, 2
    model.generation_config.pad_token_id = 3
    with atomic_output_dir(args.output, force=args.force, what="base model output") as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        write_json(tmp / "training.json", {
            "data": {"source": "python-stdlib", "python": sys.version.split()[0],
                     "train_files": len(train_files), "train_tokens": len(train),
                     "held_out_modules": list(HELD_OUT_MODULES), "held_out_tokens": len(held)},
            "model": {k: getattr(args, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                                                     "num_heads", "num_kv_heads", "max_position_embeddings")},
            "parameters": n_params, "special_tokens": list(SPECIAL_TOKENS),
            "training": {k: getattr(args, k) for k in ("seed", "steps", "batch_size", "seq_len", "lr", "warmup",
                                                        "weight_decay", "threads")},
            "device": device.type, "train_seconds": round(train_s, 1),
            "final_train_loss": round(sum(tail) / len(tail), 4), "held_out_loss": round(eval_loss, 4),
        })
    print(f"wrote {args.output} ({n_params / 1e6:.2f}M parameters)", flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
