#!/usr/bin/env python3
"""The tokens/step table of docs/models.md for the committed small pair, regenerated: eight held-out prompts (the
first three source lines of eight functions of the held-out stdlib modules), greedy, 128 new tokens, eos ignored,
fp32, torch backend on CPU, for each tree shape; ReDrafter's output checked against AR's on every prompt.

    python scripts/small_pair_table.py            # prints the markdown table (and --json FILE writes the numbers)
    python scripts/small_pair_table.py --write-prompts FILE   # only writes the prompts, as bench-engine's --prompts

Runs `trt-redrafter convert`, `build-engine` and `run --json` as a user would (one `run` per tree shape and mode).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SMALL = REPO / "models" / "small"
# (held-out module, function): the pure-Python source, as the drafter's held-out text has it
FUNCTIONS = (("textwrap", "dedent"), ("fractions", "limit_denominator"), ("shlex", "split"), ("heapq", "nsmallest"),
             ("bisect", "insort_right"), ("queue", "put_nowait"), ("sched", "enterabs"), ("colorsys", "rgb_to_hls"))
SHAPES = ((4, 4), (6, 3))


def prompts() -> list[str]:
    """The first three lines of each function's source, dedented (a definition line and the start of its body)."""
    out = []
    for module, name in FUNCTIONS:
        lines = (Path(sysconfig.get_paths()["stdlib"]) / f"{module}.py").read_text().splitlines(keepends=True)
        i = next(i for i, line in enumerate(lines) if re.match(rf"\s*def {name}\(", line))
        out.append(textwrap.dedent("".join(lines[i:i + 3])))
    return out


def cli(*args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "trt_redrafter.cli", *args], capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"trt-redrafter {args[0]} failed:\n{r.stderr[-2000:]}")
    return r.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json", type=Path, help="also write the per-prompt numbers here")
    ap.add_argument("--write-prompts", type=Path, metavar="FILE",
                    help="write the prompts as JSONL ({\"prompt\"} rows, bench-engine's --prompts) and exit")
    args = ap.parse_args()
    ps = prompts()
    if args.write_prompts:
        args.write_prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ps))
        return 0
    rows, report = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for nb, dl in SHAPES:
            ck, en = Path(tmp) / f"ck{nb}x{dl}", Path(tmp) / f"en{nb}x{dl}"
            cli("convert", "--base-model", str(SMALL / "base"), "--drafter", str(SMALL / "drafter"), "--output",
                str(ck), "--tp", "1", "--dtype", "float32", "--num-beams", str(nb), "--draft-len-per-beam", str(dl))
            cli("build-engine", "--checkpoint", str(ck), "--output", str(en), "--tokenizer", str(SMALL / "base"),
                "--max-batch-size", "8", "--max-input-len", "256", "--max-seq-len", "512")
            out = {}
            for mode in ("redrafter", "ar"):
                text = cli("run", "--engine", str(en), "--mode", mode, "--max-tokens", str(args.max_tokens), "--json",
                           "--ignore-eos", "--compile", "off", "--prompt", *ps)
                out[mode] = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
            same = all(a["output_ids"] == b["output_ids"] for a, b in zip(out["redrafter"], out["ar"]))
            tps = [d["tokens_per_step"] for d in out["redrafter"]]
            mean = sum(tps) / len(tps)
            report[f"{nb}x{dl}"] = {"tokens_per_step": tps, "mean": round(mean, 2), "identical_to_ar": same}
            rows.append(f"| {nb} x {dl} | {' '.join(f'{t:.2f}' for t in tps)} | **{mean:.2f}** (max possible {dl + 1}) "
                        f"| {'yes' if same else 'NO'} |")
    print("| num_beams x draft_len_per_beam | tokens/step per prompt | mean | ReDrafter == AR on all |")
    print("|---|---|---|---|")
    print("\n".join(rows))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(r["identical_to_ar"] for r in report.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
