"""`trt-redrafter serve`: run tritonserver on a model repository until SIGINT/SIGTERM (logic: serving/launcher.py)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve a model repository with tritonserver",
                       description="Start tritonserver on a repository made by make-repo, wait until it is "
                                   "ready, and shut it down cleanly on SIGINT or SIGTERM.")
    p.add_argument("--repo", required=True, help="model repository made by make-repo")
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--host", default="127.0.0.1", help="address every endpoint binds to")
    p.add_argument("--ready-timeout", type=float, default=180.0, help="seconds to wait for readiness")
    p.add_argument("--log-file", help="also keep tritonserver's log here (it is always echoed to stderr)")
    p.add_argument("--verbose", action="store_true", help="tritonserver --log-verbose=1")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..errors import UserError
    from ..serving.launcher import TritonServer

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server = TritonServer(args.repo, grpc_port=args.grpc_port, http_port=args.http_port,
                          metrics_port=args.metrics_port, host=args.host, ready_timeout=args.ready_timeout,
                          log_path=args.log_file, echo=sys.stderr, verbose=args.verbose)
    with server:
        print(f"serving {args.repo}: gRPC {server.grpc_url}  HTTP {server.http_url}  metrics {server.metrics_url}",
              flush=True)
        while not stop.wait(0.5):
            if server.poll() is not None:
                raise UserError(f"tritonserver exited with status {server.poll()}; its log ends with:\n"
                                f"{server.log_tail()}")
        print("shutting down", flush=True)
    print("stopped", flush=True)
    return 0
