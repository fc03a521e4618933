"""`trt-redrafter serve`: run tritonserver on a model repository until SIGINT/SIGTERM, and with --openai-port an
OpenAI-compatible API in front of it (logic: serving/launcher.py, serving/openai_api/).

serve also supervises the server: tritonserver neither notices a dead Python-backend stub (its requests are never
answered, its health stays ready) nor restarts one, so serve checks twice a second that tritonserver and each model
process are alive; on a fault it restarts tritonserver whole (launcher.Supervisor; docs/serving.md, "Faults"), at
most --max-restarts times in 10 minutes, then exits with EXIT_GAVE_UP."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading

EXIT_GAVE_UP = 3  # serve's status when it stopped restarting a failing server


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve a model repository with tritonserver",
                       description="Start tritonserver on a repository made by make-repo, wait until it is "
                                   "ready, and shut it down cleanly on SIGINT or SIGTERM. With --openai-port, also an "
                                   "OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions) in front of it.")
    p.add_argument("--repo", required=True, help="model repository made by make-repo")
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--openai-port", type=int, help="also serve the OpenAI-compatible API on this port (needs the "
                                                   "serving extra's fastapi and uvicorn)")
    p.add_argument("--openai-model-name", help="the `model` name OpenAI clients send (default: the engine "
                                               "directory's name)")
    p.add_argument("--host", help="address every endpoint binds to (default: 127.0.0.1; inside a container "
                                  "(Docker, Podman, Kubernetes) 0.0.0.0, so that published ports reach it)")
    p.add_argument("--ready-timeout", type=float, default=180.0, help="seconds to wait for readiness")
    p.add_argument("--log-file", help="also keep tritonserver's log here (it is always echoed to stderr)")
    p.add_argument("--verbose", action="store_true", help="tritonserver --log-verbose=1")
    p.add_argument("--max-restarts", type=int, default=3,
                   help="when a model process or tritonserver dies, restart tritonserver (every request in flight "
                        "gets an error at once; health is not ready until it is back), at most this many times in "
                        f"10 minutes; then exit with status {EXIT_GAVE_UP} so that a supervisor "
                        "can act (0: exit at the first fault)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..errors import UserError
    from ..serving.launcher import Supervisor, TritonServer, default_host, require_free_ports

    if args.host is None:
        args.host = default_host()
        if args.host != "127.0.0.1":  # the container default
            print(f"inside a container: binding {args.host} (reachable through the ports the container publishes; "
                  f"--host 127.0.0.1 keeps it to the container)", flush=True)

    if args.max_restarts < 0:
        raise UserError(f"--max-restarts must be 0 or more, got {args.max_restarts}.")
    ports = {"--grpc-port": args.grpc_port, "--http-port": args.http_port, "--metrics-port": args.metrics_port}
    if args.openai_port is not None:
        ports["--openai-port"] = args.openai_port
        _require_web_stack()
    require_free_ports(args.host, ports)  # before a minute of model loading, not after
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server = TritonServer(args.repo, grpc_port=args.grpc_port, http_port=args.http_port,
                          metrics_port=args.metrics_port, host=args.host, ready_timeout=args.ready_timeout,
                          log_path=args.log_file, echo=sys.stderr, verbose=args.verbose)
    with server, contextlib.ExitStack() as frontends:
        print(f"serving {args.repo}: gRPC {server.grpc_url}  HTTP {server.http_url}  metrics {server.metrics_url}",
              flush=True)
        api = None
        if args.openai_port is not None:
            from ..serving.openai_api.process import OpenAIFrontend

            api = frontends.enter_context(OpenAIFrontend(args.repo, server.grpc_url, args.openai_port, args.host,
                                                         args.openai_model_name, echo=sys.stderr))
            print(f"OpenAI-compatible API: {api.url}", flush=True)
        supervisor = Supervisor(server, args.max_restarts)
        while not stop.wait(supervisor.WATCH_PERIOD_S):
            if supervisor.check() is not None:
                return EXIT_GAVE_UP
            if api is not None and api.poll() is not None:
                raise UserError(f"the OpenAI frontend exited with status {api.poll()}; its log ends with:\n"
                                f"{api.log_tail()}")
        print("shutting down", flush=True)
    print("stopped", flush=True)
    return 0


def _require_web_stack() -> None:
    from ..errors import UserError

    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise UserError(f"--openai-port needs FastAPI and uvicorn ({e}); install the serving extra: "
                        f"pip install 'trt-redrafter[serving]'.") from e
