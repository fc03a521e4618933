"""`trt-redrafter make-repo`: a Triton model repository for an engine (logic: serving/repo.py)."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser("make-repo", help="write a Triton model repository for an engine",
                       description="Fill the Triton templates (ensemble -> preprocessing -> engine -> "
                                   "postprocessing, TensorRT-LLM's tensor names) from the engine's config.json.")
    p.add_argument("--engine", required=True, help="engine directory made by build-engine")
    p.add_argument("--output", required=True, help="model repository to write")
    p.add_argument("--tokenizer", help="tokenizer directory (default: ENGINE/tokenizer)")
    p.add_argument("--backend", choices=("torch", "tensorrtllm"),
                   help="engine model: torch (Python backend) or TensorRT-LLM's tensorrtllm backend "
                        "(default: the engine's backend)")
    p.add_argument("--decoupled", choices=("true", "false"), default="true",
                   help="the engine model's transaction policy (TensorRT-LLM's decoupled_mode): true streams "
                        "(gRPC stream clients, generate_stream); false answers each request once, which unary gRPC "
                        "ModelInfer and HTTP infer need (default: true)")
    p.add_argument("--max-queue-size", type=int, default=0,
                   help="requests that may wait beyond the running batch; more are refused at once with a "
                        "'server busy' error (TensorRT-LLM's max_queue_size; default 0: no limit)")
    p.add_argument("--force", action="store_true", help="replace an existing --output")
    from ..config import RuntimeConfig

    RuntimeConfig.add_cli_args(p.add_argument_group("runtime of the torch engine model (written into its "
                                                    "config.pbtxt)"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..config import RuntimeConfig
    from ..serving.repo import make_repo

    runtime = RuntimeConfig.from_sources(None, args)
    spec = make_repo(args.engine, args.output, args.tokenizer, args.backend, args.force, runtime=runtime,
                     decoupled=args.decoupled == "true", max_queue_size=args.max_queue_size)
    print(f"model repository written to {args.output} ({spec.backend} backend, decoupled {args.decoupled}); serve "
          f"it with `trt-redrafter serve --repo {args.output}`")
    return 0
