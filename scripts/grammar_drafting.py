#!/usr/bin/env python3
"""What each part of grammar-aware drafting gives: tokens per step of constrained ReDrafter on bench-structured's
tasks with (1) masks only (the drafter's trees as drafted), (2) trees repaired (forbidden drafts cut, forced tokens
put in), (3) repaired trees and trees of forced tokens after steps that drafted none (the engine's behaviour).
Counts steps, not time: eager, greedy, batch 1; the outputs of all three are compared (they must be equal).

    python scripts/grammar_drafting.py --engine ENGINE [--speculate auto|full] [--tasks N]
"""

from __future__ import annotations

import argparse
import json

import torch

from trt_redrafter.bench.structured import TASKS, prompt_ids
from trt_redrafter.config import Guide, GuideType, RuntimeConfig, SamplingConfig
from trt_redrafter.runtime import grammar
from trt_redrafter.runtime.distributed import Dist
from trt_redrafter.runtime.engine import Engine
from trt_redrafter.runtime.generate import generate
from trt_redrafter.serving.text import load_tokenizer

FULL_FOLLOW = grammar.Grammars.follow


def masks_only(self, seqs, floor):
    return []


def repair_only(self, seqs, floor):
    return FULL_FOLLOW(self, [s for s in seqs if s.tree_fresh], floor)


SETTINGS = {"masks only": masks_only, "+ repaired trees": repair_only, "+ forced-token trees": FULL_FOLLOW}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", required=True)
    p.add_argument("--speculate", default="auto")
    p.add_argument("--tasks", type=int, default=len(TASKS))
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args()
    tok = load_tokenizer(f"{args.engine}/tokenizer")
    engine = Engine.load(args.engine, Dist(0, 1, torch.device("cpu")),
                         RuntimeConfig(compile="off", speculate=args.speculate))
    tasks = TASKS[:args.tasks]
    ids = prompt_ids(tok, tasks)
    outputs, rows = {}, []
    for name, follow in SETTINGS.items():
        grammar.Grammars.follow = follow
        tokens = steps = accepted = 0
        outs = []
        for i, t in enumerate(tasks):
            r = generate(engine, [ids[i]], SamplingConfig(max_tokens=args.max_tokens), "redrafter",
                         (tok.eos_token_id,), guide=Guide(GuideType.JSON_SCHEMA, json.dumps(t["schema"])))[0]
            tokens, steps, accepted = tokens + len(r.output_ids) - 1, steps + r.steps, accepted + r.accepted_draft_tokens
            outs.append(r.output_ids)
        outputs[name] = outs
        rows.append((name, tokens / steps, accepted, steps))
    grammar.Grammars.follow = FULL_FOLLOW
    same = all(o == outputs["masks only"] for o in outputs.values())
    print(f"| grammar-aware drafting | tokens/step | drafts accepted | steps |  ({len(tasks)} tasks, speculate "
          f"{args.speculate}, outputs equal: {same})")
    print("|---|---|---|---|")
    for name, tps, acc, steps in rows:
        print(f"| {name} | {tps:.2f} | {acc} | {steps} |")


if __name__ == "__main__":
    main()
