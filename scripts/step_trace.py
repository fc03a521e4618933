#!/usr/bin/env python3
"""Where one compiled decode step's time goes, kernel by kernel: an AR step and a tree step (verifying T nodes and
drafting the next trees) of a real engine, traced with the PyTorch profiler and inductor's per-kernel records.

    python scripts/step_trace.py --engine out/quickstart/smollm2-engine --batch-size 1 --width 5

The step's kernels are sorted into parts: the base model's linear layers and attention (the verify, up to the end of
the largest linear layer, the lm_head), and after it the drafter (its linear layers, or on the CPU kernels its whole
beam search in one call, `beam_draft`, top-k included), its top-k where that is a call of its own, the other generated
kernels (accept, rewind, beam bookkeeping, pack) and the library ops they call (sort, cumsum, ...). `gaps` is the
time between kernels: what the compiled step's wrapper spends calling them. Per part: milliseconds per step (the
median over --steps traced steps). The tree step's extra over the AR step is what speculating costs before a single
drafted token is accepted (docs/perf.md, "CPU: what a tree step costs").

Inductor compiles the steps again with its per-kernel records (`cpp.enable_kernel_profile`), which does not reuse the
engine's compiled kernels: a few minutes the first time on 2 cores. The last stdout line is one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

import torch

PARTS = ("verify linear", "attention", "verify other", "drafter", "topk", "after-verify kernels",
         "library ops", "gaps")


def parts_of_step(events: list[dict], call: dict) -> tuple[dict[str, float], dict[str, float]]:
    """The top-level events inside one compiled-graph call (one thread), summed by part, in ms; and those after the
    verify (the drafter's, accept's, rewind's, pack's), summed by kernel name, in ms."""
    t0, t1 = call["ts"], call["ts"] + call["dur"]
    inner = sorted((e for e in events if e is not call and e["tid"] == call["tid"] and t0 <= e["ts"]
                    and e["ts"] + e["dur"] <= t1), key=lambda e: e["ts"])
    top, end = [], -1.0
    for e in inner:  # outermost only
        if e["ts"] >= end:
            top.append(e)
            end = e["ts"] + e["dur"]
    def is_linear(name: str) -> bool:  # the CPU linear kernels (cpu/linear.cpp): float, weight-only, int8 x int8
        return name.endswith(("::linear", "::linear_wo", "::linear_w8a8"))

    linear = [e for e in top if is_linear(e["name"])]
    head_end = max(linear, key=lambda e: e["dur"]) if linear else None  # the lm_head ends the verify
    cut = head_end["ts"] + head_end["dur"] if head_end else t0
    out = dict.fromkeys(PARTS, 0.0)
    after: dict[str, float] = {}
    prev = t0
    for e in top:
        out["gaps"] += e["ts"] - prev
        prev = e["ts"] + e["dur"]
        name, verify = e["name"], e["ts"] < cut
        if is_linear(name):
            part = "verify linear" if verify else "drafter"
        elif name.endswith("::beam_draft"):  # the whole beam search in one call (cpu/draft.cpp): layers and top-k
            part = "drafter"
        elif "attention" in name:
            part = "attention"
        elif name.endswith("::topk"):
            part = "topk"
        elif verify:
            part = "verify other"
        elif name.startswith("aoti_torch") or name.startswith("aten::"):
            part = "library ops"
        else:
            part = "after-verify kernels"
        out[part] += e["dur"]
        if not verify:
            after[name] = after.get(name, 0.0) + e["dur"] / 1e3
    out["gaps"] += t1 - prev
    return {k: v / 1e3 for k, v in out.items()} | {"step": call["dur"] / 1e3}, after


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", required=True)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--width", type=int, default=5, help="tree nodes the tree step verifies (T)")
    ap.add_argument("--context", type=int, default=32, help="committed positions before the step")
    ap.add_argument("--steps", type=int, default=5, help="steps traced per kind")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=0, help="also list the tree step's N costliest kernels after the verify")
    args = ap.parse_args()

    import torch._inductor.config as inductor_config

    inductor_config.cpp.enable_kernel_profile = True
    from torch.profiler import ProfilerActivity, profile

    from trt_redrafter.config import AcceptanceRule, RuntimeConfig
    from trt_redrafter.runtime.distributed import Dist
    from trt_redrafter.runtime.engine import Engine
    from trt_redrafter.runtime.launch import StepVariant
    from trt_redrafter.runtime.state import put_rows

    engine = Engine.load(args.engine, Dist(0, 1, torch.device("cpu")),
                         RuntimeConfig(threads=args.threads, compile="inductor", speculate="full"))
    launcher, cache, state = engine.launcher, engine.cache, engine.state
    bs, T, ctx = args.batch_size, args.width, args.context
    slots = sorted(engine.slots.free)[:bs]
    for i, slot in enumerate(slots):  # throw-away sequences on free slots, as the cost model's measurement
        cache.reserve(-1 - i, ctx + 2 * engine.tree.max_tree_tokens)
        cache.bind(-1 - i, slot)
    cache.sync()
    idx = torch.tensor(slots)
    greedy = AcceptanceRule.GREEDY
    kinds = {"ar": lambda: launcher.ar(slots, ctx + 1, greedy),
             f"tree T={T}": lambda: launcher.tree(slots, T, [T] * bs, ctx, StepVariant(True, greedy, True))}
    result = {"engine": args.engine, "dtype": str(engine.dtype).removeprefix("torch."), "batch": bs, "width": T,
              "context": ctx, "threads": args.threads,
              "cpp_wrapper": engine.compiler.cpp_wrapper, "loadavg": os.getloadavg(), "parts_ms": {}}
    with torch.inference_mode():
        for kind, call in kinds.items():
            def once():
                put_rows(state.ctx_len, idx, torch.full_like(idx, ctx))
                call().cpu()

            for _ in range(3):
                once()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(args.steps):
                    once()
            with tempfile.TemporaryDirectory() as d:
                prof.export_chrome_trace(f"{d}/trace.json")
                events = [e for e in json.load(open(f"{d}/trace.json"))["traceEvents"] if e.get("ph") == "X"]
            calls = [e for e in events if e["name"].startswith("## Call CompiledFxGraph")]
            steps, after = zip(*(parts_of_step(events, c) for c in calls[-args.steps:]))
            result["parts_ms"][kind] = {k: statistics.median(s[k] for s in steps) for k in steps[0]}
            names = set().union(*after)
            result.setdefault("after_verify_ms", {})[kind] = dict(sorted(
                ((n, statistics.median(a.get(n, 0.0) for a in after)) for n in names), key=lambda kv: -kv[1]))
    ar, tree = result["parts_ms"].values()
    print(f"{args.engine}: batch {bs}, context {ctx}, {args.threads} threads, C++ wrapper "
          f"{'on' if result['cpp_wrapper'] else 'off'}; ms per step, median of {args.steps} traced steps")
    print("| part | AR step | " + f"tree step (T={T}) | tree - AR |")
    print("|---|---|---|---|")
    for part in (*PARTS, "step"):
        print(f"| {part} | {ar[part]:.3f} | {tree[part]:.3f} | {tree[part] - ar[part]:+.3f} |")
    if args.top:
        kernels = result["after_verify_ms"][f"tree T={T}"]
        print(f"\nthe tree step's {args.top} costliest kernels after the verify (ms per step, of "
              f"{sum(kernels.values()):.3f} in {len(kernels)} kernels):")
        for name, ms in list(kernels.items())[:args.top]:
            print(f"  {ms:7.3f}  {name}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
