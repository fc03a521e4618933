#!/usr/bin/env python3
"""Time to first token of a request whose prompt repeats one the engine has served, with KV prefix reuse on and off
(RuntimeConfig.kv_cache_reuse), in one process, interleaved rounds: the cost a long shared system prompt or a
conversation's history adds to every request without reuse. Prompts: the tokenizer's encoding of MT-Bench questions
concatenated to --prompt-tokens (a "system prompt"), then a different short question per round; greedy.

    python scripts/prefix_reuse_ttft.py --engine out/smollm2-engine --prompt-tokens 1000
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from trt_redrafter.bench.schedule import load_prompts
from trt_redrafter.config import RuntimeConfig, SamplingConfig
from trt_redrafter.datasets import mt_bench_path
from trt_redrafter.model.tp import Dist
from trt_redrafter.runtime.engine import Engine
from trt_redrafter.runtime.generate import generate
from trt_redrafter.serving.text import load_tokenizer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mode", default="redrafter")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = load_tokenizer(f"{args.engine}/tokenizer")
    turns = [p.text for p in load_prompts(mt_bench_path(), "none")]  # MT-Bench first turns, raw text
    shared = []
    for t in turns:
        shared += tok.encode(t, add_special_tokens=False)
        if len(shared) >= args.prompt_tokens:
            break
    shared = shared[:args.prompt_tokens]
    engines = {reuse: Engine.load(args.engine, Dist(0, 1, torch.device("cpu")),
                                  RuntimeConfig(device="cpu", compile="off", kv_cache_reuse=reuse))
               for reuse in (False, True)}
    params = SamplingConfig(max_tokens=args.max_tokens)
    for e in engines.values():  # the shared prompt served once: what reuse can find
        generate(e, [shared + tok.encode(turns[-1], add_special_tokens=False)], params, args.mode)
    ttft = {False: [], True: []}
    cached, outputs = [], {False: [], True: []}
    for r in range(args.rounds):
        prompt = shared + tok.encode(turns[r], add_special_tokens=False)
        for reuse, e in engines.items():
            res = generate(e, [prompt], params, args.mode)[0]
            ttft[reuse].append(res.ttft_ms)
            outputs[reuse].append(res.output_ids)
            if reuse:
                cached.append(res.cached_tokens)
    off, on = statistics.median(ttft[False]), statistics.median(ttft[True])
    print(f"prompt {len(shared)} shared + a question, {args.rounds} rounds, {args.threads} threads, eager")
    print("| reuse | TTFT ms (median) | cached prompt tokens |")
    print("|---|---|---|")
    print(f"| off | {off:.1f} | 0 |")
    print(f"| on | {on:.1f} | {statistics.median(cached):.0f} |")
    print(f"TTFT on / off: {on / off:.3f}; outputs equal: {outputs[False] == outputs[True]}")
    return 0 if outputs[False] == outputs[True] else 1


if __name__ == "__main__":
    sys.exit(main())
