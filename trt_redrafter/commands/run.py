"""`trt-redrafter run`: decode prompts with an engine, ReDrafter or auto-regressive, on one or TP ranks."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
from pathlib import Path
from typing import Optional

from ..config import DECODING_MODES, PROPOSERS, Guide, GuideType, RuntimeConfig, SamplingConfig
from ..errors import UserError
from ..log import rank0_print
from ..prompt_args import load_prompts, resolve_end_id


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
    p.add_argument("--mode", choices=DECODING_MODES, default="redrafter",
                   help="redrafter: speculative (drafts from --proposer); ar: one token per step")
    p.add_argument("--proposer", choices=PROPOSERS,
                   help="what drafts the trees of these requests (default: the engine's, set at build time): "
                        "redrafter, ngram (learning-free) or mixed")
    SamplingConfig.add_cli_args(p)
    p.add_argument("--tokenizer", help="tokenizer directory (default: ENGINE/tokenizer)")
    p.add_argument("--end-id", type=int, help="stop token id (default: the tokenizer's EOS)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    guide = p.add_argument_group("structured output (one of them; the output follows it exactly, with or without "
                                 "speculation)").add_mutually_exclusive_group()
    guide.add_argument("--json-schema", metavar="FILE", help="a JSON schema the output validates against")
    guide.add_argument("--json-object", action="store_true", help="any JSON object")
    guide.add_argument("--regex", metavar="R", help="a regular expression the whole output matches")
    guide.add_argument("--grammar", metavar="FILE", help="an EBNF (GBNF) grammar, root rule 'root'")
    RuntimeConfig.add_cli_args(p.add_argument_group("runtime (how this process runs the engine)"))
    p.add_argument("--json", action="store_true", help="one JSON document per prompt")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..runtime.distributed import in_mpi_world, init_dist, mpirun_command, shutdown_dist
    from ..checkpoint.engine_config import load_engine_config

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
    guide = _guide(args)
    tokenizer, prompts = load_prompts(args)
    end_id = resolve_end_id(args, tokenizer)
    stop = () if end_id is None else (end_id,)

    from ..runtime.engine import Engine, frozen_heap
    from ..runtime.generate import generate
    from ..runtime.scheduler import follow

    dist = init_dist(tp, runtime.device)
    try:
        engine = Engine.load(args.engine, dist, runtime, speculative=args.mode != "ar")
        with frozen_heap():
            if dist.is_driver:
                results = generate(engine, prompts, params, args.mode, stop, proposer=args.proposer, guide=guide)
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
            if r.logprobs:
                rank0_print(_logprob_table(r.output_ids, r.logprobs, tokenizer), rank=dist.rank)
    return 0


def _logprob_table(ids: list[int], logprobs: list, tokenizer) -> str:
    """One line per output token: its position, id, text, log-probability and the most likely tokens there."""
    def show(t: int) -> str:
        return f"{t} {tokenizer.decode([t])!r}" if tokenizer is not None else str(t)

    lines = [f"{'#':>4}  {'token':<24} {'logprob':>9}  top"]
    for i, (t, lp) in enumerate(zip(ids, logprobs)):
        top = "  ".join(f"{show(j)} {x:.4f}" for j, x in lp.top)
        lines.append(f"{i:>4}  {show(t):<24} {lp.logprob:>9.4f}  {top}")
    return "\n".join(lines)


def _cuda(device: str) -> bool:
    import torch

    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def _guide(args: argparse.Namespace) -> Optional[Guide]:
    """--json-schema / --json-object / --regex / --grammar -> the requests' Guide (None: free text)."""
    if args.json_object:
        return Guide(GuideType.JSON)
    if args.regex is not None:
        return Guide.parse("regex", args.regex)
    for flag, path, kind in (("--json-schema", args.json_schema, GuideType.JSON_SCHEMA),
                             ("--grammar", args.grammar, GuideType.EBNF)):
        if path is not None:
            if not Path(path).is_file():
                raise UserError(f"{flag} {path}: no such file.")
            return Guide.parse(kind.value, Path(path).read_text())
    return None

