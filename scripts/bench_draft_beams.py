"""Paired benchmark of `--draft-beams` and `--draft-depth` settings on one engine: AR and ReDrafter under each
setting, request by request in rotating order within one process (so the machine's phases hit every setting alike),
rounds of the same prompts. Prints, per round, each setting's decode time and steps and its speedup over AR, the beam
counts and depths its drafting steps searched, and whether every setting emitted AR's tokens; with --outcomes, the
acceptance of verified nodes by (score bin, depth) under each fixed beam count (what runtime/calibration.py learns
per cell).

    python scripts/bench_draft_beams.py --engine ENGINE [--settings all,auto] [--batch-size 1] [--num-prompts 8]
        [--max-tokens 64] [--rounds 3] [--threads 2] [--outcomes 1,4]

A setting is BEAMS or BEAMS/DEPTH (`--draft-beams`, `--draft-depth`; DEPTH all where left out): `all/all,all/auto`
compares the policy's choice of depth against the whole depth.
"""

from __future__ import annotations

import argparse
import collections
import math
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", required=True)
    ap.add_argument("--settings", default="all,auto", help="--draft-beams values (or BEAMS/DEPTH pairs with "
                    "--draft-depth values) to compare, comma-separated")
    ap.add_argument("--speculate", default="auto")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--outcomes", default="", help="beam counts to tabulate node outcomes for (speculate full)")
    a = ap.parse_args()

    from transformers import AutoTokenizer

    from trt_redrafter.bench import schedule
    from trt_redrafter.bench.measure import run_mode
    from trt_redrafter.config import RuntimeConfig, SamplingConfig, Speculation
    from trt_redrafter.runtime.calibration import Calibration
    from trt_redrafter.runtime.distributed import init_dist
    from trt_redrafter.runtime.engine import Engine
    from trt_redrafter.runtime.generate import generate
    from trt_redrafter.runtime.launch import draft_beam_options, draft_depth_options

    rt = RuntimeConfig(threads=a.threads, speculate=a.speculate)
    torch.set_num_threads(a.threads)
    engine = Engine.load(a.engine, init_dist(1, rt.device), rt)
    tok = AutoTokenizer.from_pretrained(str(Path(a.engine) / "tokenizer"))
    prompts = [p.ids(tok) for p in schedule.first_prompts(schedule.load_prompts("mt-bench", "auto", tok),
                                                           a.num_prompts, "categories")]
    groups = [prompts[i:i + a.batch_size] for i in range(0, len(prompts), a.batch_size)]
    params = SamplingConfig(max_tokens=a.max_tokens)
    nb = engine.tree.num_beams
    dl = engine.tree.draft_len_per_beam

    def options(setting: str) -> tuple[list[int], list[int]]:
        beams, _, depth = setting.partition("/")
        return (draft_beam_options(beams, engine.launcher.beam_options, nb),
                draft_depth_options(depth or "all", engine.launcher.depth_options, dl))

    settings = {s: options(s) for s in a.settings.split(",")}
    if engine.policy.costs is not None:
        print(engine.policy.costs.overhead_table())

    def run(name: str, group):
        if name == "ar":
            return run_mode(engine, group, params, "ar", last=False)
        engine.policy.beam_options, engine.policy.depth_options = settings[name]
        return run_mode(engine, group, params, "redrafter", last=False)

    names = ["ar", *settings]
    for g in groups:  # compile, warm and calibrate: not counted
        for n in names:
            run(n, g)
    outputs: dict[tuple[str, int], list] = {}
    print(f"engine {a.engine}, batch {a.batch_size}, {len(prompts)} MT-Bench prompts, {a.max_tokens} tokens, "
          f"speculate {a.speculate}, {a.threads} threads, load {_load():.2f}")
    for r in range(a.rounds):
        ms, steps = collections.Counter(), collections.Counter()
        beams, depths = ({n: collections.Counter() for n in names} for _ in range(2))
        for i, g in enumerate(groups):
            k = (i + r) % len(names)
            for n in names[k:] + names[:k]:
                x = run(n, g)
                ms[n] += 1e3 * x.decode_s
                steps[n] += x.decode_steps
                beams[n].update(x.beams)
                depths[n].update(x.depths)
                outputs.setdefault((n, i), [o.output_ids for o in x.results])
        print(f"round {r}: AR {ms['ar']:.0f} ms {steps['ar']} steps | " + " | ".join(
            f"{n}: {ms[n]:.0f} ms {steps[n]} steps {ms['ar'] / ms[n]:.3f}x, drafting steps by beams "
            f"{dict(sorted(beams[n].items()))}, by depth {dict(sorted(depths[n].items()))}" for n in settings),
            flush=True)
    same = all(outputs[(n, i)] == outputs[("ar", i)] for n in settings for i in range(len(groups)))
    print(f"greedy == AR for every setting: {same}")

    counts = [int(k) for k in a.outcomes.split(",") if k]
    if counts:
        engine.policy.speculation = Speculation.parse("full")
        table = {}
        for k in counts:
            engine.policy.beam_options = draft_beam_options(str(k), engine.launcher.beam_options, nb)
            engine.policy.depth_options = [dl]
            engine.outcomes = []
            generate(engine, prompts, params, "redrafter", last=False)
            cells = collections.defaultdict(lambda: [0, 0, 0.0])
            for _, score, depth, accepted in engine.outcomes:
                c = cells[(Calibration.bin(score), depth)]
                c[0] += 1
                c[1] += accepted
                c[2] += math.exp(score / 1024)
            table[k] = cells
        keys = sorted(set().union(*table.values()))
        print("| score bin | depth | " + " | ".join(f"{k} beam(s): nodes, accepted, claimed" for k in counts) + " |")
        print("|---|---|" + "---|" * len(counts))
        for key in keys:
            cols = []
            for k in counts:
                n, acc, claim = table[k].get(key, (0, 0, 0.0))
                cols.append(f"{n}, {acc / n:.2f}, {claim / n:.2f}" if n else "-")
            print(f"| {key[0]} | {key[1]} | " + " | ".join(cols) + " |")


def _load() -> float:
    import os
    return os.getloadavg()[0]


if __name__ == "__main__":
    main()
