"""Paged KV cache: a pool of fixed-size blocks per layer, handed out to sequences on demand.

Memory is not reserved for the worst case: a sequence holds `ceil(len / block_size)` blocks and gives them back
when it finishes or is cancelled. Storage is one flat slot array per layer (`k[layer]`, `v[layer]`:
`[num_slots, kvh, D]`); a sequence's position `t` lives in slot `table[t // block_size] * block_size + t % block_size`.

Allocation is host bookkeeping (Python lists, no device work); what the device sees is `block_table`, one row per
batch slot of the engine ([max_slots, max_blocks_per_seq], on the cache's device), refreshed with one copy when a
reservation changed it (`sync`). One extra block past the pool, the scratch block, is never handed out: table
entries past a sequence's blocks point at it and padding tokens write their K/V there, so any address a static-
shape step computes is valid and no padded write lands in another sequence's cache.

Verification writes the K/V of the whole packed draft tree after the committed context; acceptance then moves the
accepted path's entries down to the next committed positions (the KV rewind, done on the device by the step); the
rejected entries are simply overwritten later.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable

import torch


class KVCacheFull(Exception):
    """Not enough free blocks for a request; the scheduler waits instead of failing."""


@dataclass
class _SeqBlocks:
    blocks: list[int] = field(default_factory=list)
    slot: int = -1  # the batch slot whose block-table row mirrors these blocks (-1: none)


class PagedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_size: int,
                 dtype: torch.dtype, device: torch.device, max_slots: int = 1, max_blocks_per_seq: int = 1):
        assert num_blocks > 0 and block_size > 0, (num_blocks, block_size)
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.scratch_block = num_blocks  # one block past the pool
        self.scratch_slot = num_blocks * block_size
        shape = ((num_blocks + 1) * block_size, kv_heads, head_size)
        # one tensor per layer, [num_slots, kvh, D]: steps write them with index_put_ on the tensor itself (not on a
        # view of a stacked one), which torch.compile keeps in place instead of copying the cache
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.device = device
        self.max_blocks_per_seq = max_blocks_per_seq
        self._table = torch.full((max_slots, max_blocks_per_seq), self.scratch_block, dtype=torch.long)  # host
        self.block_table = self._table.to(device)  # [max_slots, max_blocks_per_seq] what steps read
        self._dirty = False
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low block ids first
        self._seqs: dict[Hashable, _SeqBlocks] = {}

    # ---- accounting -----------------------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, seq_id: Hashable, num_tokens: int) -> int:
        have = len(self._seqs[seq_id].blocks) if seq_id in self._seqs else 0
        return max(0, -(-num_tokens // self.block_size) - have)

    def can_fit(self, num_tokens: int) -> bool:
        blocks = -(-num_tokens // self.block_size)
        return blocks <= self.num_blocks and blocks <= self.max_blocks_per_seq

    def reserve(self, seq_id: Hashable, num_tokens: int) -> None:
        """Make sure `seq_id` owns slots for positions [0, num_tokens)."""
        need = self.blocks_needed(seq_id, num_tokens)
        if need > len(self._free):
            raise KVCacheFull(f"sequence {seq_id} needs {need} more KV blocks, {len(self._free)} free")
        seq = self._seqs.setdefault(seq_id, _SeqBlocks())
        assert len(seq.blocks) + need <= self.max_blocks_per_seq, \
            f"sequence {seq_id} would hold {len(seq.blocks) + need} blocks > max_blocks_per_seq={self.max_blocks_per_seq}"
        for _ in range(need):
            seq.blocks.append(self._free.pop())
        if need and seq.slot >= 0:
            self._write_row(seq)

    def bind(self, seq_id: Hashable, slot: int) -> None:
        """Mirror `seq_id`'s blocks into block-table row `slot` (the sequence's batch slot)."""
        seq = self._seqs.setdefault(seq_id, _SeqBlocks())
        seq.slot = slot
        self._write_row(seq)

    def free(self, seq_id: Hashable) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self._free.extend(reversed(seq.blocks))
            if seq.slot >= 0:
                self._table[seq.slot] = self.scratch_block
                self._dirty = True

    def has(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def blocks(self, seq_id: Hashable) -> list[int]:
        return list(self._seqs[seq_id].blocks)

    def sync(self) -> None:
        """Copy the host block table to the device if a reservation or a free changed it."""
        if self._dirty:
            self.block_table.copy_(self._table, non_blocking=True)
            self._dirty = False

    def _write_row(self, seq: _SeqBlocks) -> None:
        row = self._table[seq.slot]
        row.fill_(self.scratch_block)
        row[:len(seq.blocks)] = torch.tensor(seq.blocks, dtype=torch.long)
        self._dirty = True

    # ---- addressing (host, for tests and tools) ---------------------------------------------------------
    def slots(self, seq_id: Hashable, start: int, end: int) -> torch.Tensor:
        """Flat slot indices of positions [start, end) of `seq_id`. LongTensor[end - start] on the cache device."""
        blocks = self._seqs[seq_id].blocks
        assert end <= len(blocks) * self.block_size, (seq_id, end, len(blocks), self.block_size)
        pos = torch.arange(start, end)
        table = torch.tensor(blocks, dtype=torch.long)
        return (table[pos // self.block_size] * self.block_size + pos % self.block_size).to(self.device)
