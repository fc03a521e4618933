"""Tensor-parallel process group: ranks come from MPI, collectives from `torch.distributed`.

TensorRT-LLM launches one process per rank with `mpirun`; so do we. Rank and world size come from mpi4py (or
Open MPI's environment); rank 0 picks a free TCP port and shares it through MPI, then every rank joins a
`torch.distributed` group (gloo on CPU, NCCL on CUDA). Without MPI the world is one rank and every collective
is the identity, so the single-process path pays nothing.

Failure policy: Open MPI's `mpirun` aborts the whole job when one rank exits abnormally, and the collectives
carry a timeout, so a dead peer makes the survivors fail within seconds instead of hanging.
"""

from __future__ import annotations

import datetime
import os
import shutil
import socket
import sys

import torch
import torch.distributed as tdist

from ..errors import UserError
from ..log import get_logger
from ..model.tp import Dist

logger = get_logger(__name__)

__all__ = ["Dist", "COLLECTIVE_TIMEOUT_S", "init_dist", "init_dist_tcp", "mpi_world", "mpirun_prefix", "in_mpi_world",
           "free_port", "shutdown_dist"]

# A collective that has not completed in this long means a peer is gone (normal steps take milliseconds).
COLLECTIVE_TIMEOUT_S = float(os.environ.get("TRT_REDRAFTER_COLLECTIVE_TIMEOUT", "60"))


def mpi_world() -> tuple[int, int]:
    """(rank, world_size) from the MPI launcher's environment; (0, 1) outside mpirun."""
    for rank_var, size_var in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"),
                               ("PMIX_RANK", "PMIX_SIZE")):
        if rank_var in os.environ and size_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ[size_var])
    return 0, 1


def mpirun_prefix(n: int, what: str) -> list[str]:
    """`mpirun -n N` with what Open MPI needs for ranks on one box (and as root); `what` says who needs them."""
    return mpirun_options(n, what) + ["-n", str(n)]


def mpirun_command(n: int, argv: list[str]) -> list[str]:
    """`mpirun -n N python -m trt_redrafter ARGV`: a CLI command relaunched on every rank."""
    return mpirun_prefix(n, "this engine") + [sys.executable, "-m", "trt_redrafter", *argv]


def mpirun_options(n: int, what: str) -> list[str]:
    """`mpirun` and its global options, before one or more `-n K program` application contexts."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise UserError(f"{what} needs {n} MPI rank(s) but mpirun is not installed; install Open MPI "
                        f"(apt-get install openmpi-bin) and mpi4py (pip install 'trt-redrafter[mpi]').")
    cmd = [mpirun, "--bind-to", "none", "--oversubscribe"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    return cmd


def in_mpi_world() -> bool:
    return mpi_world()[1] > 1


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_dist(tp_size: int, device: str = "auto") -> Dist:
    """Join (or skip) the TP group. `tp_size` must equal the MPI world size (one rank per shard)."""
    rank, world = mpi_world()
    if world != tp_size:
        if world == 1:
            raise UserError(f"this engine has tp_size={tp_size}; launch it with `mpirun -n {tp_size}` "
                            f"(trt-redrafter run does that for you when started outside MPI).")
        raise UserError(f"mpirun started {world} ranks but the engine has tp_size={tp_size}; use `mpirun -n {tp_size}`.")
    dev = _pick_device(device, rank)
    if world == 1:
        return Dist(0, 1, dev)
    from mpi4py import MPI  # imported only under mpirun

    comm = MPI.COMM_WORLD
    port = comm.bcast(_free_port() if rank == 0 else None, root=0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    backend = "nccl" if dev.type == "cuda" else "gloo"
    dist = Dist(rank, world, dev)  # before the group starts its threads: Dist may import dynamo (model/tp.py)
    tdist.init_process_group(backend, init_method=f"tcp://{os.environ['MASTER_ADDR']}:{port}", rank=rank,
                             world_size=world, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    logger.debug("rank %d/%d joined a %s group on %s", rank, world, backend, dev)
    return dist


def init_dist_tcp(rank: int, world_size: int, port: int, device: str = "auto",
                  addr: str = "127.0.0.1") -> Dist:
    """Join a TP group whose rendezvous address is known (serving: the Triton model instance is rank 0 and the
    follower ranks it launches with mpirun are ranks 1..tp-1)."""
    dev = _pick_device(device, rank)
    if world_size == 1:
        return Dist(0, 1, dev)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    dist = Dist(rank, world_size, dev)  # before the group starts its threads (as in init_dist)
    tdist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world_size,
                             timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return dist


def free_port() -> int:
    """A TCP port that was free a moment ago, for a TP rendezvous."""
    return _free_port()


def _pick_device(device: str, rank: int) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise UserError("--device cuda was requested but no CUDA GPU is visible; use --device cpu.")
        return torch.device("cuda", rank % torch.cuda.device_count())
    if device != "cpu":
        raise UserError(f"--device must be auto, cpu or cuda, got {device!r}.")
    return torch.device("cpu")


def shutdown_dist() -> None:
    if tdist.is_available() and tdist.is_initialized():
        tdist.destroy_process_group()
