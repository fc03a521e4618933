"""`trt-redrafter gate`: check a bench results document against a baseline (logic: trt_redrafter/bench/gate.py).

Exit status: 0 pass, 1 regression, 2 bad input (missing/malformed files, incomparable runs).
"""

from __future__ import annotations

import argparse

EXIT_REGRESSION = 1


def register(sub) -> None:
    p = sub.add_parser("gate", help="fail on a perf regression against a baseline (ratios, tokens/step, errors)",
                       description="Compare RESULTS (trt-redrafter bench's results.json) with BASELINE: per (TP, "
                                   "QPS) point the AR/ReDrafter speedup, greedy tokens/step and errors. Prints one "
                                   "line per rule per point; exits 1 on a regression, 2 on bad input.")
    p.add_argument("--baseline", required=True, help="baseline results document (e.g. ci/baseline.json)")
    p.add_argument("--results", required=True, help="results document to check")
    p.add_argument("--config", help="gate thresholds (YAML with a `gate:` section, e.g. ci/perf_gate.yaml)")
    p.add_argument("--engine-results", help="a bench-engine document (its last stdout line) of the same engine: "
                                            "gates the fixed cost of speculating (width-1 tree step / AR step)")
    p.add_argument("--update-baseline", action="store_true",
                   help="after reporting, write RESULTS as the new BASELINE (atomically) and exit 0")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..bench.gate import evaluate, load_gate_config, with_overheads
    from ..bench.report import baseline_of, load_document
    from ..errors import UserError
    from ..fsutil import read_json, write_json

    cfg = load_gate_config(args.config)
    results = load_document(args.results, "--results")
    engine_doc = read_json(args.engine_results, "--engine-results") if args.engine_results else None
    if engine_doc is not None and "speculation_overheads" not in engine_doc:
        raise UserError(f"--engine-results: {args.engine_results} has no speculation_overheads; pass the last stdout "
                        f"line of `trt-redrafter bench-engine`.")
    if args.update_baseline:
        old = None
        if Path(args.baseline).exists():
            try:
                old = load_document(args.baseline, "--baseline")
                print(evaluate(old, results, cfg, engine_doc).text())
            except UserError as e:
                print(f"note: the old baseline is not comparable ({e})")
        new = baseline_of(results)
        if engine_doc is not None:  # beside the old baseline's overheads of other kernel sets
            new = with_overheads(old, new, engine_doc)
        write_json(args.baseline, new, indent=1)
        print(f"baseline {args.baseline} updated from {args.results}"
              + (f" and {args.engine_results}" if engine_doc is not None else ""))
        return 0
    report = evaluate(load_document(args.baseline, "--baseline"), results, cfg, engine_doc)
    print(report.text())
    return 0 if report.passed else EXIT_REGRESSION
