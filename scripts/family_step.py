#!/usr/bin/env python3
"""The decode step of a Llama and a Qwen2 (or Qwen3) engine of the same shape, timed in interleaved rounds: what the
family costs per step (Qwen2's q/k/v biases, Qwen3's q/k norms) on this machine. Random weights (make-tiny at a
SmolLM2-like width, 8 layers), fp32, eager, batch 1, context 200: an AR step and a tree step verifying 5 nodes.

    python scripts/family_step.py                    # llama vs qwen2
    python scripts/family_step.py --family qwen3 --compile inductor
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from trt_redrafter.config import AcceptanceRule, RuntimeConfig
from trt_redrafter.model.tp import Dist
from trt_redrafter.runtime.engine import Engine
from trt_redrafter.runtime.launch import StepVariant
from trt_redrafter.runtime.state import put_rows

SHAPE = ["--hidden-size", "576", "--num-layers", "8", "--num-heads", "9", "--num-kv-heads", "3",
         "--intermediate-size", "1536", "--vocab-size", "8192", "--exit-dim", "512"]
CONTEXT = 200


def build(root: Path, family: str) -> Path:
    d = root / family
    for cmd in (["make-tiny", "--output", d / "pair", "--family", family, *SHAPE],
                ["convert", "--base-model", d / "pair" / "base", "--drafter", d / "pair" / "drafter", "--output",
                 d / "ck", "--dtype", "float32", "--num-beams", "4", "--draft-len-per-beam", "4"],
                ["build-engine", "--checkpoint", d / "ck", "--output", d / "en", "--max-batch-size", "4",
                 "--max-input-len", "256", "--max-seq-len", "512"]):
        subprocess.run(["trt-redrafter", *map(str, cmd)], check=True, capture_output=True)
    return d / "en"


def steps(engine: Engine) -> dict:
    """An AR step and a 5-node tree step on a throw-away request of CONTEXT tokens."""
    launcher = engine.launcher
    slots = sorted(engine.slots.free)[:1]
    launcher.cache.reserve(-1, CONTEXT + 64)
    launcher.cache.bind(-1, slots[0])
    launcher.cache.sync()
    idx = torch.tensor(slots)
    tree = StepVariant(True, AcceptanceRule.GREEDY, True)

    def at_context(call):
        put_rows(launcher.state.ctx_len, idx, torch.full_like(idx, CONTEXT))
        return call()

    return {"AR": lambda: at_context(lambda: launcher.ar(slots, CONTEXT + 1, AcceptanceRule.GREEDY)),
            "tree of 5": lambda: at_context(lambda: launcher.tree(slots, 5, [5], CONTEXT, tree))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="qwen2", choices=("qwen2", "qwen3"))
    ap.add_argument("--compile", default="off")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="family-step-"))
    calls = {}
    for family in ("llama", args.family):
        engine = Engine.load(build(root, family), Dist(0, 1, torch.device("cpu")),
                             RuntimeConfig(device="cpu", compile=args.compile, speculate="full"))
        calls[family] = steps(engine)
    times = {(f, k): [] for f in calls for k in calls[f]}
    with torch.inference_mode():
        for r in range(args.rounds + 3):  # three untimed rounds first
            for f in calls:
                for k, call in calls[f].items():
                    t = time.perf_counter()
                    call().cpu()
                    if r >= 3:
                        times[(f, k)].append(time.perf_counter() - t)
    print(f"| step | llama ms | {args.family} ms | {args.family} / llama |")
    print("|---|---|---|---|")
    for k in calls["llama"]:
        a, b = (1e3 * statistics.median(times[(f, k)]) for f in ("llama", args.family))
        print(f"| {k} | {a:.2f} | {b:.2f} | {b / a:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
