"""A request's place in the running batch, from admission to release: a row of the device state (`SlotState`: its
batch slot, with its sampling parameters) and its blocks in the paged KV cache (with the cached prefix it claims).
The scheduler reserves KV for each step through `reserve` / `tokens_needed`, preempts with `restart` and ends
requests with `release`; the engine admits a step's requests with `admit`."""

from __future__ import annotations

from .kv_cache import PagedKVCache
from .sequence import Sequence
from .state import SlotState


class BatchSlots:
    """The batch slots and KV blocks of one engine's requests."""

    def __init__(self, cache: PagedKVCache, state: SlotState, max_tree_tokens: int):
        self.cache, self.state, self.max_tree_tokens = cache, state, max_tree_tokens
        self.free = list(range(state.num_slots - 2, -1, -1))  # the last is the padding slot; pop() hands out 0 first

    def tokens_needed(self, seq: Sequence) -> int:
        """KV positions `seq` needs for its next step."""
        if seq.in_prompt_phase:
            return len(seq.prompt) + len(seq.output)
        if seq.speculative:
            return seq.ctx_len + self.max_tree_tokens  # the padded tree is written whole
        return seq.ctx_len + 1  # a tree step writes its other positions to the cache's scratch block (kv_cache.py)

    def reserve(self, seq: Sequence) -> None:
        """KV for `seq`'s next step. A request's first reservation in its prompt phase claims the cached prefix of its
        text, which its prompt step then skips (prefix reuse, kv_cache.py)."""
        if seq.in_prompt_phase and not self.cache.has(seq.seq_id):
            seq.prefix_len = self.cache.claim_prefix(seq.seq_id, seq.prompt + seq.output, salt=seq.spec.cache_salt)
            seq.stats.cached_tokens = seq.prefix_len
            seq.stats.kv_reused_blocks += seq.prefix_len // self.cache.block_size
        self.cache.reserve(seq.seq_id, self.tokens_needed(seq))

    def admit(self, seqs: list[Sequence]) -> None:
        """KV for this step, and a batch slot with the request's sampling parameters for each one new to the batch."""
        for s in seqs:
            self.reserve(s)
            if s.slot < 0:
                assert self.free, "more admitted requests than batch slots"
                s.slot = self.free.pop()
                self.cache.bind(s.seq_id, s.slot)
                self.state.set_params([s.slot], [s.sampling], [s.apple])
        self.cache.sync()

    def release(self, seq: Sequence) -> None:
        """Give back `seq`'s KV blocks (its committed full blocks stay cached for reuse) and batch slot."""
        self.cache.commit(seq.seq_id, (seq.prompt + seq.output)[:seq.ctx_len])
        self.cache.free(seq.seq_id)
        seq.pending = seq.tree = None
        seq.tree_fresh = False
        if seq.slot >= 0:
            self.free.append(seq.slot)
            seq.slot = -1

    def restart(self, seq: Sequence) -> None:
        """Forget `seq`'s KV state (after preemption); its next step recomputes prompt + output so far."""
        self.release(seq)
        seq.ctx_len, seq.prefilled = 0, False
