#!/usr/bin/env python3
"""A/B of the linear layers' implementations (RuntimeConfig.linear) on real engines, in one process: the base model's
verify step over T = 1 (an AR step) and T > 1 tokens (a draft tree, causal chain) after a real prompt, each engine
timed in turn round after round, so a loaded machine slows every variant alike. Eager steps (`--compile off`): two
compiled engines of different layouts cannot share one process (their step graphs guard only on their arguments).

    python scripts/bench_linear.py --engine /tmp/sm-eng-bfloat16 --engine /tmp/sm-eng-float32 --linear torch,onednn,avx512 \
        --tokens 1,2,4,8,16,26 --threads 2

With `--gemms`, times instead the base model's linear layers alone (every layer's, and the lm_head), each called
once on T random rows: what one verify step spends in GEMMs; with `--gemms --drafter`, the drafter's (T: the rows of
one drafted token, requests x beams), under each `--drafter-weights` value:

    python scripts/bench_linear.py --engine ENGINE --linear avx512 --gemms --drafter --drafter-weights ,w8a8 \
        --tokens 1,4,8,16,32 --threads 2

With `--prefetch 1024,0`, each engine runs once per weight prefetch distance of the CPU kernels (bytes; 0: none),
the variants timed in turn in one process:

    python scripts/bench_linear.py --engine ENGINE --linear avx512 --gemms --prefetch 1024,0 --tokens 1,2,5,9,17 \
        --threads 2

Prints per engine and T the median and minimum step time over rounds and the cost relative to that engine's T = 1,
with the load average; the last stdout line is one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from trt_redrafter.config import RuntimeConfig, SamplingConfig
from trt_redrafter.model.linear import Linear
from trt_redrafter.runtime.distributed import Dist
from trt_redrafter.runtime.engine import Engine
from trt_redrafter.runtime.sequence import RequestSpec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", action="append", required=True, help="engine directory (repeatable)")
    ap.add_argument("--linear", default="torch,onednn,avx512", help="comma-separated RuntimeConfig.linear values")
    ap.add_argument("--tokens", default="1,2,4,8,16,26", help="comma-separated tokens per verify step (T)")
    ap.add_argument("--prompt-len", type=int, default=256, help="committed context before the timed steps")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=5, help="timed calls per (engine, T) per round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gemms", action="store_true", help="time the base model's linear layers alone")
    ap.add_argument("--drafter", action="store_true", help="with --gemms: the drafter's linear layers instead")
    ap.add_argument("--prefetch", default="",
                    help="comma-separated weight prefetch distances in bytes for the CPU kernels (cpu/linear.cpp; 0: "
                         "none), each a variant timed in turn; '': as loaded (TRT_REDRAFTER_PREFETCH, else 1024)")
    ap.add_argument("--drafter-weights", default="auto",
                    help="comma-separated RuntimeConfig.drafter_weights values, each a variant ('' : as stored)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    Ts = [int(t) for t in args.tokens.split(",")]

    variants = {}
    weights = args.drafter_weights.split(",")
    for path in args.engine:
        for impl, dw in ((i, w) for i in args.linear.split(",") for w in weights):
            t0 = time.perf_counter()
            # speculate full: no step cost model to measure at load (the policy's; nothing here decodes by it)
            runtime = RuntimeConfig(device="cpu", compile="off", linear=impl, threads=args.threads, speculate="full",
                                    drafter_weights=dw)
            engine = Engine.load(path, Dist(0, 1, torch.device("cpu")), runtime)
            load_s = time.perf_counter() - t0
            g = torch.Generator().manual_seed(0)
            prompt = torch.randint(100, engine.vocab_size, (args.prompt_len,), generator=g).tolist()
            seq = engine.new_sequence(RequestSpec(prompt, SamplingConfig(max_tokens=64), mode="ar"))
            engine.step([seq])  # the prompt: KV for prompt_len positions
            engine.cache.reserve(seq.seq_id, seq.ctx_len + max(Ts))
            engine.cache.sync()
            name = f"{os.path.basename(path.rstrip('/'))}/{engine.linear}"
            if len(weights) > 1:
                name += f"/drafter {engine.drafter.dtype if not engine.drafter.weights else engine.drafter.weights}"
            variants[name] = (engine, seq, load_s)

    def gemms(engine, T: int):
        model = engine.drafter if args.drafter else engine.model
        layers = [m for m in model.modules() if isinstance(m, Linear)]
        dtype = engine.drafter.dtype if args.drafter else engine.dtype
        xs = {n: torch.randn(T, n, generator=torch.Generator().manual_seed(T)).to(dtype)
              for n in {m.in_features for m in layers}}

        def run():
            for m in layers:
                m(xs[m.in_features])
        return run

    def verify(engine, seq, T: int):
        slots = torch.tensor([seq.slot])
        tokens = torch.randint(100, engine.vocab_size, (1, T), generator=torch.Generator().manual_seed(T))
        offsets = torch.arange(T)[None]
        mask = torch.ones(T, T, dtype=torch.bool).tril()[None]
        nblk = -(-(seq.ctx_len + T) // engine.cache.block_size)
        key_blocks = torch.arange(nblk)
        return lambda: engine.steps.verify(slots, key_blocks, tokens, offsets, mask).logits.argmax(-1)

    # the prefetch variants share each engine: the distance is set before every timed call of its variant
    distances = [int(v) for v in args.prefetch.split(",")] if args.prefetch else [None]
    if distances != [None]:
        from trt_redrafter import cpu
        cpu.ops()
    named = {(f"{name}/prefetch {d}" if d is not None else name): (e, s, load_s, d)
             for name, (e, s, load_s) in variants.items() for d in distances}

    def with_prefetch(fn, d):
        if d is None:
            return fn

        def run():
            cpu.set_prefetch_bytes(d)
            return fn()
        return run

    calls = {(name, T): with_prefetch(gemms(e, T) if args.gemms else verify(e, s, T), d)
             for name, (e, s, _, d) in named.items() for T in Ts}
    times: dict[tuple, list[float]] = {k: [] for k in calls}
    with torch.inference_mode():
        for fn in calls.values():
            fn()
        for _ in range(args.rounds):
            for key, fn in calls.items():
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    fn()
                times[key].append(1e3 * (time.perf_counter() - t0) / args.calls)

    rows = []
    for name, (_, _, load_s, _) in named.items():
        ar = statistics.median(times[name, 1]) if 1 in Ts else None
        for T in Ts:
            med, best = statistics.median(times[name, T]), min(times[name, T])
            rows.append({"engine": name, "T": T, "median_ms": med, "min_ms": best,
                         "cost_vs_T1": med / ar if ar else None, "load_s": load_s})
    print("| engine/linear | T | median ms | min ms | cost vs T=1 |")
    print("|---|---|---|---|---|")
    for r in rows:
        cost = f"{r['cost_vs_T1']:.2f}" if r["cost_vs_T1"] else "-"
        print(f"| {r['engine']} | {r['T']} | {r['median_ms']:.2f} | {r['min_ms']:.2f} | {cost} |")
    load = os.getloadavg()
    what = ("the drafter's" if args.drafter else "the base's") + " linear layers alone" if args.gemms else "verify step"
    print(f"{what}, {args.threads} thread(s), eager, "
          f"{args.rounds} rounds x {args.calls} calls, load average "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs")
    print(json.dumps({"rows": rows, "prefetch": distances, "threads": args.threads, "loadavg": load,
                      "rounds": args.rounds,
                      "what": ("drafter " if args.drafter else "") + "gemms" if args.gemms else "verify"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
