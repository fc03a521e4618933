#!/usr/bin/env python3
"""How far a drafter's confidence can be trusted: acceptance of drafted tree nodes against the probability the
proposer gave them, on prompts it was not trained on (MT-Bench by default; the committed drafters were distilled on
the base's own Magpie conversations, never on MT-Bench).

Decodes the prompts greedily with every tree verified whole (`--speculate full`, so every node is observed), records
each verified node's score (the drafter's log-probability of the path to it) and whether it was accepted, and prints
and plots the reliability curve: per probability bin, the mean claimed probability against the accepted fraction,
with the node count, overall and per depth. The speculation policy learns the same curve online
(runtime/policy.py `Calibration`); this measures it offline for the record. The last stdout line is one JSON document.

    python scripts/calibration.py --engine ENGINE_DIR [--prompts mt-bench] [--num-prompts 40] [--max-tokens 96]
        [--proposer redrafter] [--plot docs/perf/calibration.png]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch

from trt_redrafter.bench import schedule
from trt_redrafter.config import RuntimeConfig, SamplingConfig
from trt_redrafter.runtime.distributed import Dist
from trt_redrafter.runtime.engine import Engine
from trt_redrafter.runtime.generate import generate
from trt_redrafter.runtime.step import SCORE_SCALE

EDGES = [1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05, 0.0]  # probability bins, high to low


def reliability(nodes: list[tuple[float, bool]]) -> list[dict]:
    rows = []
    for hi, lo in zip(EDGES, EDGES[1:]):
        inside = [(p, a) for p, a in nodes if lo < p <= hi or (lo == 0.0 and p == 0.0)]
        if inside:
            rows.append({"bin": f"({lo:.2f}, {hi:.2f}]", "claimed": sum(p for p, _ in inside) / len(inside),
                         "accepted": sum(a for _, a in inside) / len(inside), "nodes": len(inside)})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--prompts", default="mt-bench")
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--prompt-order", default="categories", choices=schedule.PROMPT_ORDERS,
                    help="categories: spread over the dataset's categories (default); file: its first --num-prompts")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--proposer", default="redrafter")
    ap.add_argument("--plot", type=Path, help="write the reliability diagram here (PNG; needs matplotlib)")
    RuntimeConfig.add_cli_args(ap, only=("threads", "drafter_dtype", "linear", "kernels", "device"))
    args = ap.parse_args()
    runtime = RuntimeConfig.from_sources(None, args).replace(compile="off", speculate="full")
    engine = Engine.load(args.engine, Dist(0, 1, torch.device("cpu" if runtime.device == "auto" else runtime.device)),
                    runtime)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(Path(args.engine) / "tokenizer"))
    prompts = [p.ids(tok) for p in schedule.first_prompts(schedule.load_prompts(args.prompts, "auto", tok),
                                                          args.num_prompts, args.prompt_order)]
    engine.outcomes = []
    params = SamplingConfig(max_tokens=args.max_tokens)
    for i in range(0, len(prompts), args.batch_size):
        generate(engine, prompts[i:i + args.batch_size], params, "redrafter", proposer=args.proposer)
    nodes = [(math.exp(s / SCORE_SCALE), a) for _, s, _, a in engine.outcomes]
    overall = reliability(nodes)
    depths = sorted({d for _, _, d, _ in engine.outcomes})
    by_depth = {d: reliability([(math.exp(s / SCORE_SCALE), a) for _, s, dd, a in engine.outcomes if dd == d])
                for d in depths}
    rd = engine.tree
    print(f"{len(prompts)} prompts x {args.max_tokens} tokens, greedy, whole {rd.num_beams} x "
          f"{rd.draft_len_per_beam} trees, proposer {args.proposer}, drafter {engine.drafter.dtype if engine.drafter else '-'}: "
          f"{len(nodes)} verified nodes, {sum(a for _, a in nodes)} accepted")
    print("| claimed probability (bin) | mean claimed | accepted | nodes |\n|---|---|---|---|")
    for r in overall:
        print(f"| {r['bin']} | {r['claimed']:.3f} | {r['accepted']:.3f} | {r['nodes']} |")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5.5, 5))
        ax.plot([0, 1], [0, 1], color="gray", lw=1, ls="--", label="calibrated")
        ax.plot([r["claimed"] for r in overall], [r["accepted"] for r in overall], "o-", lw=2, label="all nodes")
        for d in depths:
            rows = [r for r in by_depth[d] if r["nodes"] >= 20]
            ax.plot([r["claimed"] for r in rows], [r["accepted"] for r in rows], ".-", lw=1, alpha=0.7,
                    label=f"depth {d}")
        ax.set_xlabel("drafter's probability of the path to a node")
        ax.set_ylabel("fraction of such nodes accepted (greedy)")
        ax.set_title(f"{Path(args.engine).name}: {len(nodes)} nodes, {len(prompts)} MT-Bench prompts", fontsize=9)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.legend(fontsize=8)
        fig.tight_layout()
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.plot.with_name(f".{args.plot.name}.{os.getpid()}.png")
        fig.savefig(tmp, dpi=110)
        tmp.replace(args.plot)
        print(f"plot: {args.plot}")
    print(json.dumps({"engine": args.engine, "prompts": len(prompts), "max_tokens": args.max_tokens,
                      "proposer": args.proposer, "nodes": len(nodes), "overall": overall,
                      "by_depth": {str(d): rows for d, rows in by_depth.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
