#!/usr/bin/env python3
"""How steady is this machine? Decode one prompt auto-regressively again and again on one engine, in one process,
and print each run's mean AR step time with the time it ended. On a quiet machine the figures agree within a few
percent; on a shared one they move in phases (docs/perf.md), which is why the benchmarks here interleave the modes
they compare and report ratios from one run.

    python scripts/step_drift.py --engine out/perf/engine-4x4 --runs 40 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout without installing

from trt_redrafter.config import RuntimeConfig, SamplingConfig  # noqa: E402
from trt_redrafter.runtime.distributed import init_dist  # noqa: E402
from trt_redrafter.runtime.engine import Engine  # noqa: E402
from trt_redrafter.runtime.generate import generate  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile", default="auto")
    args = ap.parse_args()
    engine = Engine.load(args.engine, init_dist(1, "cpu"), RuntimeConfig(compile=args.compile, threads=args.threads))
    prompt = [100 + (7919 * i) % 30000 for i in range(args.prompt_len)]
    params = SamplingConfig(max_tokens=args.max_tokens)
    generate(engine, [prompt], params, "ar")  # warm-up
    t0, steps = time.perf_counter(), []
    for i in range(args.runs):
        engine.step_times.reset()
        generate(engine, [prompt], params, "ar")
        steps.append(engine.step_times.mean_ms("ar"))
        print(f"run {i + 1:3d}  t={time.perf_counter() - t0:6.1f}s  AR step {steps[-1]:.2f} ms", flush=True)
    print(f"AR step over {args.runs} runs: median {statistics.median(steps):.2f} ms, min {min(steps):.2f}, "
          f"max {max(steps):.2f} ({100 * (max(steps) / min(steps) - 1):.0f}% apart)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
