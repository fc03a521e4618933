"""`trt-redrafter run`: decode prompts with an engine, ReDrafter or auto-regressive, on one or TP ranks."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

from ..chat import encode_prompt
from ..config import PROPOSERS, RuntimeConfig, SamplingConfig
from ..errors import UserError
from ..log import rank0_print


def register(sub) -> None:
    p = sub.add_parser("run", help="generate text with an engine (ReDrafter or AR)",
                       description="Decode prompts with an engine. With TP > 1 it relaunches itself under mpirun.")
    p.add_argument("--engine", required=True, help="engine directory made by build-engine")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", nargs="+", help="prompt text(s); needs a tokenizer")
    src.add_argument("--prompt-ids", nargs="+", help="prompt(s) as comma-separated token ids, e.g. 1,450,4996")
    p.add_argument("--chat", action="store_true",
                   help="each --prompt is one user message, prompted in the model's chat template (the tokenizer's, "
                        "else FastChat's Vicuna v1.1)")
    p.add_argument("--mode", choices=("redrafter", "ar"), default="redrafter",
                   help="redrafter: speculative (drafts from --proposer); ar: one token per step")
    p.add_argument("--proposer", choices=PROPOSERS,
                   help="what drafts the trees of these requests (default: the engine's, set at build time): "
                        "redrafter, ngram (learning-free) or mixed")
    SamplingConfig.add_cli_args(p)
    p.add_argument("--tokenizer", help="tokenizer directory (default: ENGINE/tokenizer)")
    p.add_argument("--end-id", type=int, help="stop token id (default: the tokenizer's EOS)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    RuntimeConfig.add_cli_args(p.add_argument_group("runtime (how this process runs the engine)"))
    p.add_argument("--json", action="store_true", help="one JSON document per prompt")
    p.set_defaults(func=run)


def _parse_ids(texts: list[str]) -> list[list[int]]:
    out = []
    for t in texts:
        try:
            ids = [int(x) for x in t.replace(" ", ",").split(",") if x]
        except ValueError as e:
            raise UserError(f"--prompt-ids {t!r} is not a comma-separated list of integers.") from e
        if not ids:
            raise UserError("--prompt-ids got an empty prompt; give at least one token id.")
        out.append(ids)
    return out


def mpirun_command(n: int, argv: list[str]) -> list[str]:
    """`mpirun -n N python -m trt_redrafter ...`: the command relaunched on every rank."""
    from ..runtime.distributed import mpirun_prefix

    return mpirun_prefix(n, "this engine") + [sys.executable, "-m", "trt_redrafter", *argv]


def run(args: argparse.Namespace) -> int:
    from ..runtime.distributed import in_mpi_world, init_dist, shutdown_dist
    from ..runtime.engine_config import load_engine_config

    ecfg = load_engine_config(args.engine)
    if ecfg.backend != "torch":
        from ..backends.trtllm import run_trtllm
        return run_trtllm(args, ecfg)
    tp = ecfg.tp_size
    if tp > 1 and not in_mpi_world():
        return subprocess.call(mpirun_command(tp, args.argv))

    params = SamplingConfig.from_sources(None, args)
    runtime = RuntimeConfig.from_sources(None, args)
    if runtime.compile == "auto" and not _cuda(runtime.device):
        # a one-shot run on the CPU: compiling the step (tens of seconds) costs more than it saves
        runtime = runtime.replace(compile="off")
    tokenizer, prompts = load_prompts(args)
    end_id = resolve_end_id(args, tokenizer)
    stop = () if end_id is None else (end_id,)

    from ..runtime.engine import Engine
    from ..runtime.generate import generate
    from ..runtime.scheduler import follow

    dist = init_dist(tp, runtime.device)
    try:
        engine = Engine(args.engine, dist, runtime)
        if dist.is_driver:
            results = generate(engine, prompts, params, args.mode, stop, proposer=args.proposer)
        else:
            follow(engine)
            results = []
    finally:
        shutdown_dist()
    for r in results:
        text = tokenizer.decode(r.output_ids, skip_special_tokens=True) if tokenizer else None
        if args.json:
            doc = {"output_ids": r.output_ids, "text": text, **{k: v for k, v in dataclasses.asdict(r).items()
                                                                if k not in ("prompt", "output_ids")}}
            rank0_print(json.dumps(doc), rank=dist.rank)
        else:
            rank0_print(text if text is not None else " ".join(map(str, r.output_ids)), rank=dist.rank)
    return 0


def _cuda(device: str) -> bool:
    import torch

    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def load_prompts(args) -> tuple[object, list[list[int]]]:
    """(tokenizer or None, prompt token ids) from --prompt texts (with --chat: each one user message in the
    model's chat template) or --prompt-ids."""
    if args.chat and args.prompt is None:
        raise UserError("--chat templates --prompt texts; --prompt-ids are decoded as given, so drop one of them.")
    tokenizer = _load_tokenizer(args)
    if args.prompt is None:
        return tokenizer, _parse_ids(args.prompt_ids)
    if tokenizer is None:
        raise UserError(f"--prompt needs a tokenizer but {args.engine} has none; pass --tokenizer DIR or use --prompt-ids.")
    return tokenizer, [encode_prompt(tokenizer, t, chat=args.chat) for t in args.prompt]


def resolve_end_id(args, tokenizer) -> int | None:
    """The stop token: --end-id, else the tokenizer's EOS; None with --ignore-eos or when neither exists."""
    if args.ignore_eos:
        return None
    return args.end_id if args.end_id is not None else (tokenizer.eos_token_id if tokenizer else None)


def _load_tokenizer(args):
    path = Path(args.tokenizer) if args.tokenizer else Path(args.engine) / "tokenizer"
    if not path.is_dir():
        if args.tokenizer:
            raise UserError(f"--tokenizer {path} is not a directory.")
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load a tokenizer from {path}: {e}") from e
