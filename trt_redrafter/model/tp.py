"""The model's view of tensor parallelism: this rank, the group size, its device, and the collectives.

How ranks are launched and joined (mpirun, rendezvous, timeouts) is the runtime's business
(`runtime.distributed`); the model only needs the collectives. With one rank every collective is the identity,
so the single-process path pays nothing and traces to nothing under `torch.compile`.

On the CPU (gloo) the collectives run eagerly, outside compiled graphs: `torch.compile` splits a step's graph at
each one. Traced into an inductor graph as functional collectives, gloo's asynchronous all-gather/all-reduce
corrupted the heap ("malloc(): unaligned tcache chunk detected", then signal 6 or 11 at the all-gather's
wait_tensor in the drafter's graph) in 3 of 14 runs of a TP=2 compiled engine measuring its step costs, and once in CI;
a CPU step gains nothing from having them in the graph (no CUDA graphs to capture). On CUDA (NCCL) they stay
in the graph, where CUDA graphs capture them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as tdist


@dataclass
class Dist:
    """This process's place in the TP group and the collectives the model needs."""

    rank: int
    world_size: int
    device: torch.device
    _all_reduce: Callable = field(init=False, repr=False, compare=False)
    _all_gather: Callable = field(init=False, repr=False, compare=False)
    _broadcast: Callable = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        self._all_reduce, self._all_gather, self._broadcast = _all_reduce, _all_gather, _broadcast
        if self.world_size > 1 and self.device.type != "cuda":
            # the CPU's collectives are never traced (module docstring). Wrapped here, not at import:
            # torch.compiler.disable imports dynamo and with it triton, whose jit reads TRITON_INTERPRET when a kernel
            # is defined (tests set it before they import the kernels)
            self._all_reduce = torch.compiler.disable(_all_reduce)
            self._all_gather = torch.compiler.disable(_all_gather)
            # the decode step's broadcasts of rank 0's decisions too: dynamo would otherwise break the graph inside
            # the process group's Python call, warning that it cannot trace a pybind11 constructor
            self._broadcast = torch.compiler.disable(_broadcast)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (row-parallel linears)."""
        if self.world_size > 1:
            self._all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `x` along `dim` (column-parallel outputs, vocab-parallel logits)."""
        if self.world_size == 1:
            return x
        return self._all_gather(x, self.world_size, dim)

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise max over ranks, in place (load time: a row-parallel layer's quantization scales)."""
        if self.world_size > 1:
            tdist.all_reduce(x, op=tdist.ReduceOp.MAX)
        return x

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank `src`'s value everywhere; decisions (accepted tokens, drafts) use this so ranks never drift."""
        if self.world_size > 1:
            self._broadcast(x, src)
        return x

    def broadcast_object(self, obj=None, src: int = 0):
        if self.world_size == 1:
            return obj
        box = [obj]
        tdist.broadcast_object_list(box, src)
        return box[0]

    def barrier(self) -> None:
        if self.world_size > 1:
            tdist.barrier()


def _all_reduce(x: torch.Tensor) -> None:
    tdist.all_reduce(x)


def _broadcast(x: torch.Tensor, src: int) -> None:
    tdist.broadcast(x, src)


def _all_gather(x: torch.Tensor, world_size: int, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(world_size)]
    tdist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)
