"""The KV rewind on CUDA: move each request's accepted-path K/V entries down to their committed positions, in every
layer's K and V cache, in one launch.

Oracle: `runtime.step.move_kv` (a gather then a scatter per layer cache). One program per (cache tensor, request)
copies that request's rows in path order. Order matters: with path [0, 2, 5], row 2 moves to 1 and then row 5 to
2, so row 2 must be read before it is overwritten; within a request sources are increasing and never below their
destination, so copying in order (a barrier between rows) reads every source before anything overwrites it.
Requests touch disjoint slots, so they run in parallel. The caches are separate tensors (one per layer); the kernel
addresses them as element offsets from the first one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _move_kernel(base_ptr, offsets_ptr, src_ptr, dst_ptr, BL, ROW, BLOCK: tl.constexpr):
    cache = tl.program_id(0)
    b = tl.program_id(1)
    off = tl.load(offsets_ptr + cache)  # element offset of this cache tensor from the first
    for m in range(BL):
        s = tl.load(src_ptr + b * BL + m)
        d = tl.load(dst_ptr + b * BL + m)
        if s != d:
            for c0 in range(0, ROW, BLOCK):
                c = c0 + tl.arange(0, BLOCK)
                ok = c < ROW
                x = tl.load(base_ptr + off + s * ROW + c, mask=ok)
                tl.store(base_ptr + off + d * ROW + c, x, mask=ok)
        tl.debug_barrier()


class KVMover:
    """Bound to one engine's caches (their addresses never change), so each call is one launch."""

    def __init__(self, caches: list[torch.Tensor]):
        first = caches[0]
        assert all(c.dtype == first.dtype and c.shape == first.shape and c.is_contiguous() and c.device == first.device
                   for c in caches), "every cache tensor must have the first one's dtype, shape and device, contiguous"
        size = first.element_size()
        deltas = [c.data_ptr() - first.data_ptr() for c in caches]
        assert all(d % size == 0 for d in deltas), "cache tensors must be element-aligned"
        self.base = first
        self.offsets = torch.tensor([d // size for d in deltas], dtype=torch.long, device=first.device)
        self.row = first[0].numel()  # elements of one slot: kvh * D

    def __call__(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """src, dst [bs, bl] int64 slot indices; each row of src increasing with src >= dst."""
        assert src.shape == dst.shape and src.dim() == 2 and src.dtype == dst.dtype == torch.long, \
            f"src and dst must be int64 [bs, bl], got {tuple(src.shape)}, {tuple(dst.shape)}"
        bs, bl = src.shape
        _move_kernel[(self.offsets.numel(), bs)](self.base, self.offsets, src.contiguous(), dst.contiguous(), bl,
                                                 self.row, BLOCK=min(1024, triton.next_power_of_2(self.row)))
