"""Paged KV cache: a pool of fixed-size blocks per layer, handed out to sequences on demand.

Memory is not reserved for the worst case: a sequence holds `ceil(len / block_size)` blocks and gives them back
when it finishes or is cancelled. Storage is one flat slot array per layer, `[num_blocks * block_size, kvh, D]`;
a sequence's token `t` lives in slot `table[t // block_size] * block_size + t % block_size`.

Verification writes the K/V of the whole packed draft tree after the committed context; acceptance then moves
the accepted path's entries down to the next committed positions (`compact`), which is the KV rewind: the
rejected entries are simply overwritten later.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch



class KVCacheFull(Exception):
    """Not enough free blocks for a request; the scheduler waits instead of failing."""


@dataclass
class _SeqBlocks:
    blocks: list[int] = field(default_factory=list)


class PagedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_size: int,
                 dtype: torch.dtype, device: torch.device):
        assert num_blocks > 0 and block_size > 0, (num_blocks, block_size)
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        shape = (num_layers, num_blocks * block_size, kv_heads, head_size)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, slots, kvh, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.device = device
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low block ids first
        self._seqs: dict[int, _SeqBlocks] = {}

    # ---- accounting -----------------------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, seq_id: int, num_tokens: int) -> int:
        have = len(self._seqs[seq_id].blocks) if seq_id in self._seqs else 0
        return max(0, -(-num_tokens // self.block_size) - have)

    def can_fit(self, num_tokens: int) -> bool:
        return -(-num_tokens // self.block_size) <= self.num_blocks

    def reserve(self, seq_id: int, num_tokens: int) -> None:
        """Make sure `seq_id` owns slots for positions [0, num_tokens)."""
        need = self.blocks_needed(seq_id, num_tokens)
        if need > len(self._free):
            raise KVCacheFull(f"sequence {seq_id} needs {need} more KV blocks, {len(self._free)} free")
        seq = self._seqs.setdefault(seq_id, _SeqBlocks())
        for _ in range(need):
            seq.blocks.append(self._free.pop())

    def free(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self._free.extend(reversed(seq.blocks))

    def has(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    # ---- addressing -----------------------------------------------------------------------------------
    def slots(self, seq_id: int, start: int, end: int) -> torch.Tensor:
        """Flat slot indices of positions [start, end) of `seq_id`. LongTensor[end - start] on the cache device."""
        blocks = self._seqs[seq_id].blocks
        assert end <= len(blocks) * self.block_size, (seq_id, end, len(blocks), self.block_size)
        pos = torch.arange(start, end)
        table = torch.tensor(blocks, dtype=torch.long)
        return (table[pos // self.block_size] * self.block_size + pos % self.block_size).to(self.device)

    def compact(self, seq_id: int, base: int, src_offsets: torch.Tensor) -> None:
        """KV rewind: move entries at positions base + src_offsets[m] to base + m, for every layer.

        `src_offsets` is increasing with src_offsets[m] >= m (tree ancestors precede descendants), so a gather
        followed by a scatter never reads an entry that was already overwritten.
        """
        n = int(src_offsets.numel())
        if n == 0:
            return
        span = int(src_offsets.max()) + 1
        all_slots = self.slots(seq_id, base, base + span)
        src = all_slots[src_offsets.to(all_slots.device)]
        dst = all_slots[:n]
        if torch.equal(src, dst):
            return
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]
