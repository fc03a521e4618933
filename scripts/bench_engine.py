#!/usr/bin/env python3
"""Offline engine benchmark: AR vs ReDrafter on the same engine, same prompts, same run.

For each repeat, every prompt is decoded greedily with AR and with ReDrafter (alternating which goes first), at
batch size 1 by default so ms/token is per-request latency. Reports the median over repeats of the per-request
median TPOT, tokens/step, acceptance, and the AR/ReDrafter ratio. The last stdout line is one JSON document.

    python scripts/bench_engine.py --engine ENGINE_DIR [--prompts ../shared/data/mt_bench_questions.jsonl]
        [--num-prompts 8] [--max-tokens 64] [--repeats 5] [--batch-size 1]
With TP > 1 run it under `mpirun -n TP` (rank 0 prints).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

from trt_redrafter.bench import schedule
from trt_redrafter.config import SamplingConfig
from trt_redrafter.runtime.distributed import init_dist, shutdown_dist
from trt_redrafter.runtime.engine import Engine
from trt_redrafter.runtime.engine_config import load_engine_config
from trt_redrafter.runtime.generate import generate
from trt_redrafter.runtime.scheduler import follow

DEFAULT_PROMPTS = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "mt_bench_questions.jsonl"
BUILTIN_PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def __init__(self):",
                   "The quick brown fox"]


def load_prompts(path: Path | None, n: int) -> list[str]:
    """The first n prompts of an MT-Bench / {"prompt"} JSONL file (the harness's reader), else a few built-in ones."""
    if path is None or not path.is_file():
        return BUILTIN_PROMPTS[:n]
    return schedule.load_prompts(path)[:n]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=1, help="requests decoded together")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    ecfg = load_engine_config(args.engine)
    dist = init_dist(ecfg.tp_size)
    engine = Engine(args.engine, dist)
    if not dist.is_driver:  # mirror every generate() rank 0 runs, until it says it is done
        while dist.broadcast_object(None) == "more":
            follow(engine)
        shutdown_dist()
        return 0

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(Path(args.engine) / "tokenizer"))
    max_in = engine.build.max_input_len
    prompts = [tok.encode(p)[-max_in:] for p in load_prompts(args.prompts, args.num_prompts)]
    max_tokens = min(args.max_tokens, engine.build.max_seq_len - max(map(len, prompts)))
    params = SamplingConfig(max_tokens=max_tokens)

    def run(mode):
        res = []
        for i in range(0, len(prompts), args.batch_size):
            dist.broadcast_object("more")
            res += generate(engine, prompts[i:i + args.batch_size], params, mode)
        return res

    run("redrafter")  # warm-up (excluded)
    per_mode = {"ar": [], "redrafter": []}
    last = {}
    for rep in range(args.repeats):
        for mode in (("ar", "redrafter") if rep % 2 == 0 else ("redrafter", "ar")):
            res = run(mode)
            per_mode[mode].append(statistics.median(r.ms_per_token for r in res))
            last[mode] = res
        print(f"repeat {rep + 1}/{args.repeats}: AR {per_mode['ar'][-1]:.2f} ms/token, "
              f"ReDrafter {per_mode['redrafter'][-1]:.2f} ms/token", file=sys.stderr)
    dist.broadcast_object("done")
    shutdown_dist()

    rd = last["redrafter"]
    summary = {
        "engine": str(args.engine), "tp": ecfg.tp_size, "dtype": engine.build.dtype,
        "num_beams": engine.redrafter.num_beams, "draft_len_per_beam": engine.redrafter.draft_len_per_beam,
        "prompts": len(prompts), "max_tokens": max_tokens, "batch_size": args.batch_size, "repeats": args.repeats,
        "ar_ms_per_token": statistics.median(per_mode["ar"]),
        "redrafter_ms_per_token": statistics.median(per_mode["redrafter"]),
        "tokens_per_step": statistics.mean(r.tokens_per_step for r in rd),
        "acceptance_rate": sum(r.accepted_draft_tokens for r in rd) / max(1, sum(r.draft_tokens for r in rd)),
        "greedy_outputs_equal": [r.output_ids for r in rd] == [r.output_ids for r in last["ar"]],
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "device": str(dist.device)},
    }
    summary["speedup"] = summary["ar_ms_per_token"] / summary["redrafter_ms_per_token"]
    print(f"| mode | ms/token (median of {args.repeats}) | tokens/step |\n|---|---|---|\n"
          f"| AR | {summary['ar_ms_per_token']:.2f} | 1.00 |\n"
          f"| ReDrafter | {summary['redrafter_ms_per_token']:.2f} | {summary['tokens_per_step']:.2f} |\n"
          f"speedup (AR / ReDrafter ms/token): {summary['speedup']:.2f}x; greedy outputs equal: "
          f"{summary['greedy_outputs_equal']}")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
