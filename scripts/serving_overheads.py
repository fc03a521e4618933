#!/usr/bin/env python3
"""What two serving features cost when they buy nothing: KV prefix reuse's bookkeeping when no prompt shares a block
with another, and log-probabilities (a step that also returns each token's and its top-N's). One process, batch 1,
greedy, MT-Bench first turns in the chat template. The engine is loaded three times: reuse off (every configuration
without reuse), and reuse on once for AR and once for ReDrafter, so that each of those sees every prompt once and
finds nothing to reuse. Every prompt is decoded in each configuration back to back, the order rotated from prompt to
prompt; ratios of ms/token (request time / output tokens) are taken per prompt and their median and quartiles
printed.

    python scripts/serving_overheads.py --engine out/smollm2-engine --rounds 8 --prompts-per-round 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from trt_redrafter.bench.engine_bench import memory_roofline
from trt_redrafter.bench.schedule import load_prompts
from trt_redrafter.config import RuntimeConfig, SamplingConfig
from trt_redrafter.model.tp import Dist
from trt_redrafter.runtime.engine import Engine
from trt_redrafter.runtime.generate import generate
from trt_redrafter.serving.text import load_tokenizer

# (name, engine, mode, top logprobs or None)
CONFIGS = (("AR", "off", "ar", None), ("AR, reuse on", "on-ar", "ar", None), ("AR, logprobs top-5", "off", "ar", 5),
           ("ReDrafter", "off", "redrafter", None), ("ReDrafter, reuse on", "on-redrafter", "redrafter", None),
           ("ReDrafter, logprobs top-5", "off", "redrafter", 5))
RATIOS = (("AR, reuse on", "AR", "reuse bookkeeping, AR"),
          ("ReDrafter, reuse on", "ReDrafter", "reuse bookkeeping, ReDrafter"),
          ("AR, logprobs top-5", "AR", "logprobs, AR"),
          ("ReDrafter, logprobs top-5", "ReDrafter", "logprobs, ReDrafter"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prompts-per-round", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile", default="auto")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = load_tokenizer(f"{args.engine}/tokenizer")
    prompts = [p.ids(tok) for p in load_prompts("mt-bench", "auto", tok)]
    need = (args.rounds + 1) * args.prompts_per_round
    if need > len(prompts):
        raise SystemExit(f"{need} distinct prompts needed, MT-Bench has {len(prompts)}; fewer rounds or prompts")
    engines = {key: Engine.load(args.engine, Dist(0, 1, torch.device("cpu")),
                                RuntimeConfig(device="cpu", compile=args.compile, kv_cache_reuse=key != "off",
                                              threads=args.threads))
               for key in ("off", "on-ar", "on-redrafter")}
    roofline = memory_roofline(engines["off"], torch.device("cpu"))
    ms: dict[str, list[float]] = {name: [] for name, *_ in CONFIGS}
    pairs: list[dict[str, float]] = []  # per prompt: every configuration's ms/token, run back to back
    for r in range(args.rounds + 1):  # round 0 warms up (compiles the log-probability variants) and is not counted
        for j, prompt in enumerate(prompts[r * args.prompts_per_round:(r + 1) * args.prompts_per_round]):
            k = (r * args.prompts_per_round + j) % len(CONFIGS)
            this = {}
            for name, key, mode, top in CONFIGS[k:] + CONFIGS[:k]:
                params = SamplingConfig(max_tokens=args.max_tokens, logprobs=top is not None, top_logprobs=top or 0)
                res = generate(engines[key], [prompt], params, mode)[0]
                assert res.cached_tokens == 0, "a prompt found cached blocks: the measurement wants none"
                this[name] = (res.ttft_ms + res.ms_per_token * (len(res.output_ids) - 1)) / len(res.output_ids)
            if r:
                pairs.append(this)
                for name in this:
                    ms[name].append(this[name])
    print(f"engine {args.engine}, batch 1, {args.max_tokens} tokens, {args.threads} threads, compile {args.compile}, "
          f"{len(pairs)} prompts (after {args.prompts_per_round} to warm up); load average "
          f"{os.getloadavg()[0]:.2f}; read bandwidth {roofline['read_gb_s']:.1f} GB/s")
    print("| configuration | ms/token (median of prompts) |\n|---|---|")
    for name, *_ in CONFIGS:
        print(f"| {name} | {statistics.median(ms[name]):.2f} |")
    print("\n| what | cost (median of per-prompt ratios) | quartiles |\n|---|---|---|")
    doc = {"ms_per_token": {k: statistics.median(v) for k, v in ms.items()}, "ratios": {}}
    for a, b, what in RATIOS:
        ratios = [x[a] / x[b] for x in pairs]
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        doc["ratios"][what] = statistics.median(ratios)
        print(f"| {what} | {100 * (statistics.median(ratios) - 1):+.1f}% | {100 * (q1 - 1):+.1f}% .. "
              f"{100 * (q3 - 1):+.1f}% |")
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
