"""`trt-redrafter bench-structured`: JSON-schema tasks with constrained AR, constrained ReDrafter and llama.cpp in one
run (logic: trt_redrafter/bench/structured.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..config import RuntimeConfig


def register(sub) -> None:
    p = sub.add_parser("bench-structured", help="structured output: JSON-schema tasks, constrained AR vs ReDrafter "
                                                "vs llama.cpp",
                       description="Decode the project's extraction and tool-call tasks (each with a JSON schema) at "
                                   "batch 1, greedy, with constrained AR and constrained ReDrafter on one engine, "
                                   "order alternated task by task, and with llama.cpp on the same prompt ids and "
                                   "schemas (--gguf). Prints validity, ms/token, tokens/step, the host's grammar time "
                                   "per step and the ratios to AR; writes every run as JSON.")
    p.add_argument("--engine", required=True, help="engine directory made by build-engine (torch backend, TP 1, "
                                                   "with a tokenizer)")
    p.add_argument("--gguf", help="the same model as GGUF for llama.cpp (re-typed to --llama-cpp-type beside it)")
    p.add_argument("--llama-cpp-type", default="f32", help="llama.cpp weight type: f32, bf16, q8_0, q4_1")
    p.add_argument("--rounds", type=int, default=3, help="passes over the tasks (each task's median is taken)")
    p.add_argument("--max-tokens", type=int, default=128, help="output cap per task")
    p.add_argument("--tasks", type=int, default=0, help="the first N tasks only (0: all)")
    p.add_argument("--output", default="out/bench-structured/results.json", help="where the JSON document goes")
    RuntimeConfig.add_cli_args(p.add_argument_group("runtime (how this process runs the engine)"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import os

    import torch

    from ..bench import structured as S
    from ..bench.baselines import LLAMA_CPP_TYPES
    from ..bench.engine_bench import read_bandwidth
    from ..checkpoint.engine_config import load_engine_config
    from ..errors import UserError
    from ..fsutil import write_json
    from ..runtime.distributed import Dist
    from ..runtime.engine import Engine
    from ..serving.text import load_tokenizer

    for name in ("rounds", "max_tokens"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}.")
    if args.llama_cpp_type not in LLAMA_CPP_TYPES:
        raise UserError(f"--llama-cpp-type must be one of {', '.join(LLAMA_CPP_TYPES)}, got {args.llama_cpp_type!r}.")
    if args.gguf and not Path(args.gguf).is_file():
        raise UserError(f"--gguf {args.gguf}: no such file.")
    ecfg = load_engine_config(args.engine)
    if ecfg.backend != "torch" or ecfg.tp_size != 1:
        raise UserError(f"bench-structured runs a torch engine at TP 1; {args.engine} is a {ecfg.backend} engine at "
                        f"tp={ecfg.tp_size}.")
    tasks = S.TASKS[:args.tasks] if args.tasks else S.TASKS
    runtime = RuntimeConfig.from_sources(None, args)
    tok = load_tokenizer(Path(args.engine) / "tokenizer")
    machine = {"loadavg_before": os.getloadavg(), "read_gb_s_before": read_bandwidth()}
    engine = Engine.load(args.engine, Dist(0, 1, torch.device("cpu")), runtime)
    runs = S.run_engine(engine, tok, tasks, args.rounds, args.max_tokens)
    del engine
    if args.gguf:
        runs += S.run_llama_cpp(Path(args.gguf), args.llama_cpp_type, tok, tasks, args.rounds, args.max_tokens,
                                torch.get_num_threads())
    machine.update(loadavg_after=os.getloadavg(), read_gb_s_after=read_bandwidth(),
                   torch_threads=torch.get_num_threads())
    summaries = S.summarize(runs)
    print(S.table(summaries))
    doc = {"engine": str(Path(args.engine).absolute()), "command": ["trt-redrafter", *args.argv],
           "runtime": runtime.to_dict(), "machine": machine, "rounds": args.rounds, "max_tokens": args.max_tokens,
           "tasks": tasks, "summary": [s.__dict__ for s in summaries],
           "runs": [{**r.__dict__, "ms_per_token": r.ms_per_token} for r in runs]}
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, doc)
    print(json.dumps({"results": str(out), **{s.mode: {"valid": s.valid, "vs_ar": s.vs_ar} for s in summaries}}))
    return 0
