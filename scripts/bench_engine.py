#!/usr/bin/env python3
"""Offline engine benchmark: AR vs ReDrafter on the same engine, same prompts, same run, at one or more batch sizes.

For each repeat and batch size, the prompts are decoded greedily with AR and with ReDrafter (alternating which
goes first), `--batch-size` requests at a time. Reports, per batch size, the median over repeats of the per-request
median TPOT (ms/token), the mean decode-step time of each mode (`Engine.step_times`: launch to read-back), their
ratio (the ReDrafter-step / AR-step cost), tokens/step, and the speedup; then a phase breakdown of one ReDrafter
request (verify / accept / rewind / draft / pack, `--profile-phases` timing). The last stdout line is one JSON
document. Thread count, compile mode and the machine's load average are recorded with the numbers.

    python scripts/bench_engine.py --engine ENGINE_DIR [--prompts ../shared/data/mt_bench_questions.jsonl]
        [--num-prompts 8] [--max-tokens 64] [--repeats 5] [--batch-size 1,8] [--threads 1] [--compile auto]
With TP > 1 run it under `mpirun -n TP` (rank 0 prints).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from trt_redrafter.bench import schedule
from trt_redrafter.config import RuntimeConfig, SamplingConfig
from trt_redrafter.runtime.distributed import init_dist, shutdown_dist
from trt_redrafter.runtime.engine import PHASES, Engine
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
    ap.add_argument("--batch-size", default="1", help="comma-separated batch sizes (requests decoded together)")
    RuntimeConfig.add_cli_args(ap)
    args = ap.parse_args()
    runtime = RuntimeConfig.from_sources(None, args)
    batches = [int(b) for b in args.batch_size.split(",")]

    ecfg = load_engine_config(args.engine)
    dist = init_dist(ecfg.tp_size, runtime.device)
    t0 = time.perf_counter()
    engine = Engine(args.engine, dist, runtime)
    load_s = time.perf_counter() - t0
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

    def run(mode: str, bs: int):
        res = []
        for i in range(0, len(prompts), bs):
            dist.broadcast_object("more")
            res += generate(engine, prompts[i:i + bs], params, mode)
        return res

    for bs in batches:
        run("redrafter", bs), run("ar", bs)  # warm-up (excluded): first variants compile / capture here
    rows = []
    for bs in batches:
        tpot = {"ar": [], "redrafter": []}
        step = {"ar": [], "redrafter": []}
        last = {}
        for rep in range(args.repeats):
            for mode in (("ar", "redrafter") if rep % 2 == 0 else ("redrafter", "ar")):
                engine.step_times.reset()
                res = run(mode, bs)
                tpot[mode].append(statistics.median(r.ms_per_token for r in res))
                step[mode].append(engine.step_times.mean_ms(mode))
                last[mode] = res
        rd = last["redrafter"]
        row = {"batch_size": bs,
               "ar_ms_per_token": statistics.median(tpot["ar"]),
               "redrafter_ms_per_token": statistics.median(tpot["redrafter"]),
               "ar_step_ms": statistics.median(step["ar"]), "redrafter_step_ms": statistics.median(step["redrafter"]),
               "tokens_per_step": statistics.mean(r.tokens_per_step for r in rd),
               "acceptance_rate": sum(r.accepted_draft_tokens for r in rd) / max(1, sum(r.draft_tokens for r in rd)),
               "greedy_outputs_equal": [r.output_ids for r in rd] == [r.output_ids for r in last["ar"]]}
        row["speedup"] = row["ar_ms_per_token"] / row["redrafter_ms_per_token"]
        row["step_cost_ratio"] = row["redrafter_step_ms"] / row["ar_step_ms"]
        rows.append(row)
        print(f"batch {bs}: AR {row['ar_ms_per_token']:.3f} ms/token, ReDrafter {row['redrafter_ms_per_token']:.3f} "
              f"ms/token ({row['speedup']:.2f}x)", file=sys.stderr)

    engine.timer.enabled = True  # phase breakdown of one ReDrafter request (each phase its own graph)
    dist.broadcast_object("more")
    generate(engine, prompts[:1], params, "redrafter")
    engine.timer.reset()
    dist.broadcast_object("more")
    generate(engine, prompts[:1], params, "redrafter")
    phases = engine.timer.mean_ms()
    dist.broadcast_object("done")
    shutdown_dist()

    summary = {
        "engine": str(args.engine), "tp": ecfg.tp_size, "dtype": str(engine.dtype).removeprefix("torch."),
        "num_beams": engine.redrafter.num_beams, "draft_len_per_beam": engine.redrafter.draft_len_per_beam,
        "prompts": len(prompts), "max_tokens": max_tokens, "repeats": args.repeats, "batches": rows,
        "phases_ms": phases, "runtime": runtime.to_dict(), "compile": engine.compiler.mode, "kernels": engine.kernels,
        "engine_load_s": load_s,
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(), "loadavg": os.getloadavg(), "device": str(dist.device)},
    }
    print(f"{ecfg.tp_size} rank(s), {summary['dtype']}, nb={summary['num_beams']} dl={summary['draft_len_per_beam']}, "
          f"compile {engine.compiler.mode}, kernels {engine.kernels}, {torch.get_num_threads()} torch thread(s), "
          f"load average {os.getloadavg()[0]:.2f}; medians of {args.repeats} repeats")
    print("| batch | AR ms/token | ReDrafter ms/token | speedup | AR step ms | ReDrafter step ms | step cost ratio | "
          "tokens/step | greedy equal |\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch_size']} | {r['ar_ms_per_token']:.3f} | {r['redrafter_ms_per_token']:.3f} | "
              f"{r['speedup']:.2f}x | {r['ar_step_ms']:.3f} | {r['redrafter_step_ms']:.3f} | "
              f"{r['step_cost_ratio']:.2f} | {r['tokens_per_step']:.2f} | {r['greedy_outputs_equal']} |")
    total = sum(phases.values()) or 1.0
    print("ReDrafter step phases (batch 1, each phase timed alone): " + ", ".join(
        f"{k} {phases.get(k, 0.0):.3f} ms ({100 * phases.get(k, 0.0) / total:.0f}%)" for k in PHASES))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
