"""`trt-redrafter generate`: one request to a served model over gRPC streaming (logic: serving/client.py)."""

from __future__ import annotations

import argparse
import json
import sys


def register(sub) -> None:
    p = sub.add_parser("generate", help="send a prompt to a running server (gRPC streaming)",
                       description="Send one request to a model served by `trt-redrafter serve` and print the "
                                   "text as it arrives (with --stream) or once complete.")
    p.add_argument("--url", default="127.0.0.1:8001", help="the server's gRPC HOST:PORT")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true",
                   help="send the prompt as one user message: the server prompts it in the model's chat template "
                        "(the tokenizer's, else Vicuna v1.1); needs a repository made by make-repo")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--end-id", type=int, help="stop token id (default: the tokenizer's EOS; -1: none)")
    p.add_argument("--stop-word", action="append", default=[], help="stop when this text is generated (repeatable)")
    p.add_argument("--stream", action="store_true", help="ask for one response per step and print each chunk")
    p.add_argument("--model", default="ensemble")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--json", action="store_true", help="print the result and its statistics as one JSON document")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..errors import UserError
    from ..serving.client import GenerationRequest, generate_one
    from ..serving.launcher import parse_host_port

    host, port = parse_host_port(args.url, 8001)
    req = GenerationRequest(prompt=args.prompt, apply_chat_template=args.chat, max_tokens=args.max_tokens,
                            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                            end_id=args.end_id, stop_words=tuple(args.stop_word), stream=args.stream)
    live = args.stream and not args.json

    def on_chunk(chunk):
        if live:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()

    try:
        out = generate_one(f"{host}:{port}", req, model=args.model, on_chunk=on_chunk, timeout=args.timeout)
    except Exception as e:  # tritonclient raises its own types for unreachable servers
        raise UserError(f"cannot reach a Triton server at {host}:{port}: {e}") from e
    if out.error is not None:
        raise UserError(f"the server refused the request: {out.error}")
    if args.json:
        print(json.dumps(out.summary()))
    elif live:
        print()
    else:
        print(out.text)
    return 0
