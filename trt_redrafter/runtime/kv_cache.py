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

Prefix reuse (`reuse=True`): a full block of committed tokens is keyed by the hash chain of its tokens (its own and
every block's before it, so equal keys mean equal K/V: one cache serves one engine's weights). A request's first
reservation claims the longest chain of its text's blocks the cache holds (`claim_prefix`), at most all but its last
token (the prompt step must compute at least one token for its logits), and prefills only the rest. Blocks are
refcounted; a shared block is never written (every write lands at or past a request's committed length, which
starts after the claimed blocks). A request's full blocks are keyed when its prompt is committed and when it is
released (its answer's blocks too: the next turn of a conversation reuses them), and a released block that has a
key stays cached, evictable, until a new block is needed and no free one is left: the least recently released goes.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Hashable, Sequence

import torch


class KVCacheFull(Exception):
    """Not enough free blocks for a request; the scheduler waits instead of failing."""


@dataclass
class _SeqBlocks:
    blocks: list[int] = field(default_factory=list)
    slot: int = -1  # the batch slot whose block-table row mirrors these blocks (-1: none)


class PagedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_size: int,
                 dtype: torch.dtype, device: torch.device, max_slots: int = 1, max_blocks_per_seq: int = 1,
                 reuse: bool = False):
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
        # prefix reuse: the key of each keyed block and back, holders per block, keyed blocks nobody holds (oldest
        # released first), each sequence's salt (from its claim until it is freed), and counts since the cache was made
        self.reuse = reuse
        self._salts: dict[Hashable, str] = {}
        self._key_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._refs: dict[int, int] = {}
        self._cached: OrderedDict[int, None] = OrderedDict()
        self.stats = {"reused_blocks": 0, "new_blocks": 0, "evicted_blocks": 0}

    # ---- accounting -----------------------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        """Blocks a reservation can take: free ones and cached ones nobody holds (evicted when taken)."""
        return len(self._free) + len(self._cached)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - self.free_blocks

    @property
    def cached_blocks(self) -> int:
        """Keyed blocks nobody holds: reusable until evicted."""
        return len(self._cached)

    def blocks_needed(self, seq_id: Hashable, num_tokens: int) -> int:
        have = len(self._seqs[seq_id].blocks) if seq_id in self._seqs else 0
        return max(0, -(-num_tokens // self.block_size) - have)

    def can_fit(self, num_tokens: int) -> bool:
        blocks = -(-num_tokens // self.block_size)
        return blocks <= self.num_blocks and blocks <= self.max_blocks_per_seq

    def reserve(self, seq_id: Hashable, num_tokens: int) -> None:
        """Make sure `seq_id` owns slots for positions [0, num_tokens)."""
        need = self.blocks_needed(seq_id, num_tokens)
        if need > self.free_blocks:
            raise KVCacheFull(f"sequence {seq_id} needs {need} more KV blocks, {self.free_blocks} free")
        seq = self._seqs.setdefault(seq_id, _SeqBlocks())
        assert len(seq.blocks) + need <= self.max_blocks_per_seq, \
            f"sequence {seq_id} would hold {len(seq.blocks) + need} blocks > max_blocks_per_seq={self.max_blocks_per_seq}"
        for _ in range(need):
            seq.blocks.append(self._take())
        self.stats["new_blocks"] += need
        if need and seq.slot >= 0:
            self._write_row(seq)

    def _take(self) -> int:
        """A block for a reservation: a free one, else the least recently released cached one (its key dropped)."""
        if self._free:
            b = self._free.pop()
        else:
            b, _ = self._cached.popitem(last=False)
            del self._block_of[self._key_of.pop(b)]
            self.stats["evicted_blocks"] += 1
        self._refs[b] = 1
        return b

    # ---- prefix reuse ---------------------------------------------------------------------------------
    def _keys(self, tokens: Sequence[int], n_blocks: int, salt: str = "") -> list[bytes]:
        """The hash chain of the first `n_blocks` full blocks of `tokens`, started from the request's `salt` (vLLM's
        `cache_salt`: only requests with the same salt share blocks; none, the empty salt, is a salt of its own)."""
        bs = self.block_size
        prev = hashlib.blake2b(salt.encode(), digest_size=16, person=b"cache_salt").digest() if salt else b""
        keys = []
        for i in range(n_blocks):
            prev = hashlib.blake2b(prev + repr(list(tokens[i * bs:(i + 1) * bs])).encode(), digest_size=16).digest()
            keys.append(prev)
        return keys

    def claim_prefix(self, seq_id: Hashable, tokens: Sequence[int], limit: int | None = None, salt: str = ""
                     ) -> int:
        """For a sequence with no blocks yet: hold the cached blocks of the longest prefix of `tokens` the cache has
        under `salt` (whole blocks, leaving at least the last token to compute; at most `limit` tokens) -> the tokens
        reused. Its later commits key its blocks under the same salt."""
        assert seq_id not in self._seqs, f"sequence {seq_id} already holds blocks"
        if not self.reuse:
            return 0
        self._salts[seq_id] = salt
        most = (len(tokens) - 1) // self.block_size
        if limit is not None:
            most = min(most, limit // self.block_size)
        blocks = []
        for key in self._keys(tokens, most, salt):
            b = self._block_of.get(key)
            if b is None:
                break
            blocks.append(b)
        if blocks:
            for b in blocks:
                self._cached.pop(b, None)
                self._refs[b] = self._refs.get(b, 0) + 1
            self._seqs[seq_id] = _SeqBlocks(blocks)
            self.stats["reused_blocks"] += len(blocks)
        return len(blocks) * self.block_size

    def commit(self, seq_id: Hashable, tokens: Sequence[int]) -> None:
        """Key `seq_id`'s full blocks of `tokens`, the tokens whose K/V it has committed, under the salt it claimed
        with. A block whose key another block already has keeps no key (the other one is what later requests get)."""
        if not self.reuse or seq_id not in self._seqs:
            return
        blocks = self._seqs[seq_id].blocks
        n = min(len(tokens) // self.block_size, len(blocks))
        for b, key in zip(blocks, self._keys(tokens, n, self._salts.get(seq_id, ""))):
            if b in self._key_of:
                continue
            if key not in self._block_of:
                self._key_of[b], self._block_of[key] = key, b

    def bind(self, seq_id: Hashable, slot: int) -> None:
        """Mirror `seq_id`'s blocks into block-table row `slot` (the sequence's batch slot)."""
        seq = self._seqs.setdefault(seq_id, _SeqBlocks())
        seq.slot = slot
        self._write_row(seq)

    def free(self, seq_id: Hashable) -> None:
        """Give back `seq_id`'s blocks: a block nobody else holds becomes free, or cached if it has a key."""
        seq = self._seqs.pop(seq_id, None)
        self._salts.pop(seq_id, None)
        if seq is not None:
            for b in reversed(seq.blocks):
                self._refs[b] -= 1
                if self._refs[b]:
                    continue
                del self._refs[b]
                if b in self._key_of:
                    self._cached[b] = None  # the most recently released: evicted last
                else:
                    self._free.append(b)
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
