"""`trt-redrafter bench`: ms/token of AR vs ReDrafter at several QPS and TP sizes (logic: trt_redrafter/bench)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def register(sub) -> None:
    from ..bench.harness import BenchConfig

    p = sub.add_parser("bench", help="measure ms/token of AR vs ReDrafter under Poisson load",
                       description="Send Poisson streams of requests to served engines (AR and ReDrafter, each TP "
                                   "size, each QPS, interleaved) and write results.json, results.md and PNG plots. "
                                   "Either drive a running server (--url) or let bench start tritonserver on engine "
                                   "dirs (--engines, or --ar-engine/--redrafter-engine). See docs/perf.md.")
    src = p.add_argument_group("what to measure (one of)")
    src.add_argument("--url", help="gRPC HOST:PORT of a running server (one engine; AR via decoding_mode)")
    src.add_argument("--engines", help="TP=DIR list, e.g. tp1=out/e1,tp2=out/e2 (torch engines: both modes each)")
    src.add_argument("--ar-engine", action="append", default=[], help="engine dir decoding AR (repeatable, one per TP)")
    src.add_argument("--redrafter-engine", action="append", default=[],
                     help="ReDrafter engine dir (repeatable, one per TP)")
    p.add_argument("--tp", type=int, default=1, help="with --url: the served engine's TP size (a label)")
    p.add_argument("--tokenizer", help="with --url: the served model's tokenizer directory, which decides the chat "
                                       "template (without it, auto applies Vicuna v1.1); engine dirs bring theirs")
    p.add_argument("--output", default="out/bench", help="directory for results.json, results.md and the plots")
    p.add_argument("--config", help="YAML file with a `bench:` section; flags override it")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots (no matplotlib needed)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    p.add_argument("--server-logs", help="keep the started servers' logs in this directory")
    BenchConfig.add_cli_args(p)
    from ..config import RuntimeConfig

    RuntimeConfig.add_cli_args(p.add_argument_group("runtime of the torch engines this command serves"))
    p.set_defaults(func=run)


def _engine_map(spec: str | None, dirs: list[str], flag: str) -> dict[int, str]:
    from ..errors import UserError
    from ..checkpoint.engine_config import load_engine_config

    out: dict[int, str] = {}
    items = [s for s in (spec or "").split(",") if s.strip()]
    for item in items:
        key, sep, d = item.partition("=")
        if not sep or not key.strip().lower().startswith("tp") or not key.strip()[2:].isdigit():
            raise UserError(f"{flag}: expected tpN=DIR items like tp1=out/e1,tp2=out/e2, got {item!r}.")
        out[int(key.strip()[2:])] = d.strip()
    for d in dirs:
        out[load_engine_config(d).tp_size] = d
    for tp, d in out.items():
        actual = load_engine_config(d).tp_size
        if actual != tp:
            raise UserError(f"{flag}: {d} is a tp={actual} engine but is listed as tp{tp}.")
    return out


def run(args: argparse.Namespace) -> int:
    from ..bench.harness import BenchConfig, Target, engines_info, run_sweep, serve_engines
    from ..bench.report import make_document, write_outputs
    from ..bench.gate import load_yaml_sections
    from ..errors import UserError
    from ..serving.launcher import parse_host_port

    recipe = load_yaml_sections(args.config, (BenchConfig.SECTION,)) if args.config else None
    cfg = BenchConfig.from_sources(recipe, args)
    modes = cfg.mode_list()
    given = [bool(args.url), bool(args.engines), bool(args.ar_engine or args.redrafter_engine)]
    if sum(given) != 1:
        raise UserError("give exactly one of --url, --engines, or --ar-engine/--redrafter-engine.")
    if args.tokenizer and not args.url:
        raise UserError("--tokenizer goes with --url; engine dirs are benchmarked with their own tokenizer.")
    if args.url:
        host, port = parse_host_port(args.url, 8001)
        # redrafter is the engine's default: send decoding_mode only for AR, so a TensorRT-LLM ensemble (which
        # has no such input) can still be measured with --modes redrafter
        targets = [Target(args.tp, m, f"{host}:{port}", "ar" if m == "ar" else None, None,
                          m if m in ("ngram", "mixed") else None) for m in modes]
        doc_sweep = run_sweep(targets, cfg, show_progress=not args.no_progress, tokenizer_dir=args.tokenizer)
        engines = {}
    else:
        if args.engines:
            ar = rd = _engine_map(args.engines, [], "--engines")
        else:
            ar = _engine_map(None, args.ar_engine, "--ar-engine")
            rd = _engine_map(None, args.redrafter_engine, "--redrafter-engine")
        logs = Path(args.server_logs) if args.server_logs else None
        if logs:
            logs.mkdir(parents=True, exist_ok=True)
        from ..config import RuntimeConfig

        runtime = RuntimeConfig.from_sources(None, args)
        with serve_engines(ar, rd, modes, log_dir=logs, runtime=runtime) as targets:
            doc_sweep = run_sweep(targets, cfg, show_progress=not args.no_progress)
            engines = engines_info(targets)
    import dataclasses

    # the template applied, auto resolved: the gate compares it between runs
    config = {**dataclasses.asdict(cfg), "chat_template": doc_sweep["prompts"]["chat_template"]}
    doc = make_document(config, doc_sweep, engines, command=["trt-redrafter", *args.argv])
    if not args.url:
        doc["runtime"] = runtime.to_dict()
    files = write_outputs(doc, args.output, plots=not args.no_plots)
    print(files["markdown"].read_text())
    errors = sum(p["metrics"]["errors"] for p in doc["points"])
    print(json.dumps({"results": str(files["json"]), "errors": errors,
                      "speedups": [{k: s[k] for k in ("tp", "qps", "mode", "speedup")} for s in doc["speedups"]],
                      "files": {k: str(v) for k, v in files.items()}}))
    if errors:
        print(f"warning: {errors} request(s) failed; see error_samples in {files['json']}", file=sys.stderr)
    return 0
