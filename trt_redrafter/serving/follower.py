"""TP ranks 1..tp-1 of a served engine. The engine model (rank 0, inside tritonserver) launches them with
`mpirun -n TP-1 python -m trt_redrafter.serving.follower ...`; each mirrors rank 0's scheduler steps.

A follower must never outlive the server: it exits when rank 0 says stop, when a collective times out
(TRT_REDRAFTER_COLLECTIVE_TIMEOUT), or when the watchdog sees the launching process gone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time

from ..log import get_logger

logger = get_logger(__name__)

WATCHDOG_PERIOD_S = 1.0


def follower_command(engine_dir: str, tp: int, port: int, parent_pid: int, runtime=None) -> list[str]:
    """mpirun command that starts ranks 1..tp-1 (rank = OMPI_COMM_WORLD_RANK + 1), with rank 0's runtime config."""
    from ..config import RuntimeConfig
    from ..runtime.distributed import mpirun_prefix

    runtime = runtime or RuntimeConfig()
    return mpirun_prefix(tp - 1, f"serving a tp={tp} engine") + [
        python_executable(), "-m", "trt_redrafter.serving.follower", "--engine", str(engine_dir), "--port", str(port),
        "--world-size", str(tp), "--parent-pid", str(parent_pid), "--runtime-config", json.dumps(runtime.to_dict())]


def python_executable() -> str:
    """This interpreter; inside a Triton Python-backend stub sys.executable may name the stub, not python."""
    exe = sys.executable or ""
    if os.path.basename(exe).startswith("python"):
        return exe
    return shutil.which("python3") or "python3"


def launch_followers(engine_dir: str, tp: int, port: int, runtime=None) -> subprocess.Popen:
    return subprocess.Popen(follower_command(engine_dir, tp, port, os.getpid(), runtime))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _watchdog(parent_pid: int) -> None:
    while _alive(parent_pid):
        time.sleep(WATCHDOG_PERIOD_S)
    logger.warning("follower pid %d: rank 0 (pid %d) is gone; exiting", os.getpid(), parent_pid)
    os._exit(1)  # the main thread may be blocked in a collective; nothing to flush


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trt_redrafter.serving.follower")
    p.add_argument("--engine", required=True)
    p.add_argument("--port", type=int, required=True, help="rank 0's TCP rendezvous port")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--parent-pid", type=int, default=0, help="exit when this process is gone (the engine model)")
    p.add_argument("--runtime-config", default="", help="RuntimeConfig as JSON (rank 0's)")
    a = p.parse_args(argv)
    if a.parent_pid:
        threading.Thread(target=_watchdog, args=(a.parent_pid,), name="parent-watchdog", daemon=True).start()

    from ..config import RuntimeConfig
    from ..runtime.distributed import init_dist_tcp, mpi_world, shutdown_dist
    from ..runtime.engine import Engine, frozen_heap
    from ..runtime.scheduler import follow

    runtime = RuntimeConfig.from_dict(json.loads(a.runtime_config)) if a.runtime_config else RuntimeConfig()
    rank = mpi_world()[0] + 1
    assert 0 < rank < a.world_size, (rank, a.world_size)
    dist = init_dist_tcp(rank, a.world_size, a.port, runtime.device)
    try:
        engine = Engine.load(a.engine, dist, runtime)
        with frozen_heap():
            follow(engine)
    finally:
        shutdown_dist()
    return 0


if __name__ == "__main__":
    sys.exit(main())
