"""Command-line entry points. Thin: parse flags, call the library, turn `UserError` into exit status 2."""

from __future__ import annotations

import argparse
import importlib
import sys

from . import __version__
from .errors import EXIT_USER_ERROR, UserError

# subcommand -> module under trt_redrafter.commands exposing `register(subparsers)`
COMMANDS = ("convert", "make_tiny", "import_gguf", "build_engine", "run", "train_drafter", "make_repo", "serve",
            "generate", "bench", "bench_engine", "bench_reuse", "bench_structured", "gate")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trt-redrafter", description=__doc__)
    p.add_argument("--version", action="version", version=f"trt-redrafter {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f".commands.{name}", __package__).register(sub)
    return p


def _dispatch(args: argparse.Namespace) -> int:
    try:
        return int(args.func(args) or 0)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    args.argv = argv  # commands that relaunch themselves (under mpirun) pass these on
    return _dispatch(args)


def build_engine_main(argv: list[str] | None = None) -> int:
    """`build-engine ...` is `trt-redrafter build-engine ...`."""
    return main(["build-engine", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
