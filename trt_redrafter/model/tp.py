"""The model's view of tensor parallelism: this rank, the group size, its device, and the collectives.

How ranks are launched and joined (mpirun, rendezvous, timeouts) is the runtime's business
(`runtime.distributed`); the model only needs the collectives. With one rank every collective is the identity,
so the single-process path pays nothing and traces to nothing under `torch.compile`.

On the CPU (gloo) the collectives run eagerly, outside compiled graphs: `torch.compile` splits a step's graph at
each one. Traced into an inductor graph as functional collectives, gloo's asynchronous all-gather/all-reduce
crashed a rank with signal 11 in about one run in six of the TP=2 compiled test (in the drafter's graph, in CI and
here); a CPU step gains nothing from having them in the graph (no CUDA graphs to capture). On CUDA (NCCL) they stay
in the graph, where CUDA graphs capture them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as tdist


@dataclass
class Dist:
    """This process's place in the TP group and the collectives the model needs."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (row-parallel linears)."""
        if self.world_size > 1:
            (_all_reduce if self.device.type == "cuda" else _all_reduce_eager)(x)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `x` along `dim` (column-parallel outputs, vocab-parallel logits)."""
        if self.world_size == 1:
            return x
        return (_all_gather if self.device.type == "cuda" else _all_gather_eager)(x, self.world_size, dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank `src`'s value everywhere; decisions (accepted tokens, drafts) use this so ranks never drift."""
        if self.world_size > 1:
            tdist.broadcast(x, src)
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


def _all_gather(x: torch.Tensor, world_size: int, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(world_size)]
    tdist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


# the CPU's: never traced (module docstring)
_all_reduce_eager = torch.compiler.disable(_all_reduce)
_all_gather_eager = torch.compiler.disable(_all_gather)
