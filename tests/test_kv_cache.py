"""Paged KV cache accounting, addressing and the rewind (`compact`) it does after acceptance."""

import pytest
import torch

from trt_redrafter.model.attention import AttentionBatch, SpanSpec, causal_mask
from trt_redrafter.runtime.kv_cache import KVCacheFull, PagedKVCache


def make_cache(num_blocks=4, block_size=4, layers=2):
    return PagedKVCache(layers, num_blocks, block_size, kv_heads=1, head_size=2, dtype=torch.float32,
                        device=torch.device("cpu"))


def test_reserve_grows_by_blocks_and_free_returns_them():
    c = make_cache()
    c.reserve(7, 5)  # 5 tokens -> 2 blocks of 4
    assert c.used_blocks == 2
    c.reserve(7, 8)  # still 2 blocks
    assert c.used_blocks == 2
    c.reserve(7, 9)
    assert c.used_blocks == 3
    c.free(7)
    assert c.used_blocks == 0 and not c.has(7)


def test_reserve_beyond_capacity_raises_and_keeps_state():
    c = make_cache(num_blocks=2)
    c.reserve(1, 4)
    with pytest.raises(KVCacheFull):
        c.reserve(2, 9)
    assert c.used_blocks == 1


def test_slots_follow_the_block_table():
    c = make_cache(num_blocks=4, block_size=4)
    c.reserve(1, 4)  # block 0
    c.reserve(2, 4)  # block 1
    c.reserve(1, 6)  # block 2 for positions 4..5 of seq 1
    assert c.slots(1, 0, 6).tolist() == [0, 1, 2, 3, 8, 9]
    assert c.slots(2, 1, 3).tolist() == [5, 6]


def test_compact_moves_accepted_path_entries_down_in_every_layer():
    c = make_cache(num_blocks=4, block_size=4)
    c.reserve(1, 12)
    slots = c.slots(1, 0, 12)
    for li in range(2):
        c.k[li, slots] = torch.arange(12, dtype=torch.float32)[:, None, None].expand(12, 1, 2) + 100 * li
        c.v[li, slots] = -c.k[li, slots]
    # committed context = 3 entries; tree written at 3..10; accepted path = packed [0, 2, 5, 7]
    c.compact(1, 3, torch.tensor([0, 2, 5, 7]))
    for li in range(2):
        got = c.k[li, slots][:, 0, 0].tolist()
        assert got[:7] == [100 * li + x for x in [0, 1, 2, 3, 5, 8, 10]]
        assert torch.equal(c.v[li, slots[:7]], -c.k[li, slots[:7]])


def test_attention_batch_masks_context_tree_and_padding():
    c = make_cache(num_blocks=8, block_size=4)
    c.reserve(0, 3)
    c.reserve(1, 2 + 3)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # root with two children
    spans = [SpanSpec(0, 0, torch.arange(3), causal_mask(3)),
             SpanSpec(1, 2, torch.tensor([2, 3, 3]), tree)]
    b = AttentionBatch.build(spans, c)
    assert b.q_lens == [3, 3] and b.q_starts == [0, 3]
    assert b.positions.tolist() == [0, 1, 2, 2, 3, 3]
    m = b.mask[:, 0]
    assert m[0, :, :3].tolist() == causal_mask(3).tolist()
    assert not m[0, :, 3:].any()
    assert m[1, :, :2].all()  # committed context visible to every tree token
    assert m[1, :, 2:5].tolist() == tree.tolist()
    assert b.write_slots.tolist() == c.slots(0, 0, 3).tolist() + c.slots(1, 2, 5).tolist()
