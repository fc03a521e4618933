#!/usr/bin/env python3
"""How long a long prompt holds up the requests decoding beside it, with chunked prefill on and off
(RuntimeConfig.enable_chunked_context, max_num_tokens): 4 requests decode; after a few steps a prompt of
--prompt-tokens (MT-Bench questions, tokenized) arrives. Per stream: the longest gap between its tokens over its median
gap, and whether every output equals the unchunked run's. One process, eager, greedy.

    python scripts/chunked_prefill_gaps.py --engine out/smollm2-engine --prompt-tokens 1000 --max-num-tokens 128
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from trt_redrafter.bench.schedule import load_prompts
from trt_redrafter.config import RuntimeConfig, SamplingConfig
from trt_redrafter.datasets import mt_bench_path
from trt_redrafter.model.tp import Dist
from trt_redrafter.runtime.engine import Engine
from trt_redrafter.runtime.scheduler import Request, Scheduler
from trt_redrafter.runtime.sequence import RequestSpec
from trt_redrafter.serving.text import load_tokenizer


def run(engine_dir: str, chunked: bool, budget: int, streams: list[list[int]], long: list[int], mode: str,
        max_tokens: int) -> tuple[list[float], list[list[int]]]:
    engine = Engine.load(engine_dir, Dist(0, 1, torch.device("cpu")),
                         RuntimeConfig(device="cpu", compile="off", enable_chunked_context=chunked,
                                       max_num_tokens=budget if chunked else 0, kv_cache_reuse=False))
    sched = Scheduler(engine)
    times: dict[int, list[float]] = {i: [] for i in range(len(streams))}
    reqs = []
    for i, p in enumerate(streams):
        def on_tokens(req, tokens, final, i=i):
            if tokens:
                times[i].append(time.perf_counter())
        reqs.append(sched.submit(Request(i, RequestSpec(p, SamplingConfig(max_tokens=max_tokens), mode=mode),
                                         on_tokens=on_tokens)))
    for _ in range(5):
        sched.step_once()
    reqs.append(sched.submit(Request("long", RequestSpec(long, SamplingConfig(max_tokens=8), mode=mode))))
    sched.run_until_idle()
    ratios = []
    for i in times:
        gaps = [b - a for a, b in zip(times[i][1:], times[i][2:])]  # after the first (prompt) token
        ratios.append(max(gaps) / statistics.median(gaps))
    return ratios, [r.seq.output for r in reqs]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--max-num-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mode", default="ar")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = load_tokenizer(f"{args.engine}/tokenizer")
    turns = [p.text for p in load_prompts(mt_bench_path(), "none")]  # MT-Bench first turns, raw text
    streams = [tok.encode(t, add_special_tokens=False) for t in turns[:4]]
    long = []
    for t in turns[4:]:
        long += tok.encode(t, add_special_tokens=False)
        if len(long) >= args.prompt_tokens:
            break
    long = long[:args.prompt_tokens]
    off, out_off = run(args.engine, False, 0, streams, long, args.mode, args.max_tokens)
    on, out_on = run(args.engine, True, args.max_num_tokens, streams, long, args.mode, args.max_tokens)
    print(f"4 streams ({args.mode}, {args.max_tokens} tokens each), a {len(long)}-token prompt after 5 steps, "
          f"{args.threads} threads, eager")
    print("| chunked prefill | longest gap / median gap, per stream |")
    print("|---|---|")
    print(f"| off | {', '.join(f'{r:.1f}' for r in off)} |")
    print(f"| on, max_num_tokens {args.max_num_tokens} | {', '.join(f'{r:.1f}' for r in on)} |")
    print(f"outputs equal: {out_on == out_off}")
    return 0 if out_on == out_off else 1


if __name__ == "__main__":
    sys.exit(main())
