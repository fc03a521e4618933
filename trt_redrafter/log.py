"""One logger per module; rank-0 printing through one helper."""

from __future__ import annotations

import logging
import os
import sys

_CONFIGURED = False


def get_logger(name: str) -> logging.Logger:
    global _CONFIGURED
    if not _CONFIGURED:
        level = os.environ.get("TRT_REDRAFTER_LOG", "INFO").upper()
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[trt-redrafter] %(levelname)s %(message)s"))
        root = logging.getLogger("trt_redrafter")
        root.addHandler(handler)
        root.setLevel(level)
        root.propagate = False
        _CONFIGURED = True
    return logging.getLogger(name)


def rank0_print(*args, rank: int = 0, **kwargs) -> None:
    """print() on rank 0 only, so TP runs print one copy of user-facing output."""
    if rank == 0:
        print(*args, **kwargs, flush=True)
