"""The OpenAI frontend process: `python -m trt_redrafter.serving.openai_api --repo R --grpc-url H:P --port N`.

`trt-redrafter serve --openai-port N` starts it (process.py) once tritonserver is ready; run by hand it serves a
tritonserver started elsewhere. It binds its port itself before loading anything, so a port in use is one error
line and exit status 2. SIGINT or SIGTERM: uvicorn stops accepting, lets open requests finish for
GRACEFUL_SHUTDOWN_S, then cancels them (and so their Triton requests) and exits 0.
"""

from __future__ import annotations

import argparse
import errno
import signal
import socket
import sys

from ...errors import EXIT_USER_ERROR, UserError
from . import GRACEFUL_SHUTDOWN_S


def bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise UserError(f"port {port} on {host} is in use by another program; stop it or pass another "
                            f"--openai-port.") from e
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror}.") from e
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trt_redrafter.serving.openai_api", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repo", required=True, help="the model repository tritonserver serves (made by make-repo)")
    p.add_argument("--grpc-url", default="127.0.0.1:8001", help="tritonserver's gRPC endpoint")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--model-name", help="the name clients send as `model` (default: the engine directory's name)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    args = p.parse_args(argv)
    try:
        sock = bind(args.host, args.port)
        import uvicorn

        from .app import create_app
        from .engine_client import served_model

        app = create_app(served_model(args.repo, args.model_name), args.grpc_url)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    # uvicorn shuts down gracefully on either signal, then re-raises it under the handler it found: make SIGTERM's
    # that of SIGINT (KeyboardInterrupt), so both end in exit status 0
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it shut down for
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
