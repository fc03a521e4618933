"""Paged KV cache accounting, addressing, the device block table, the rewind after acceptance, and the attention
mask built from the block table and the tree."""

import pytest
import torch

from trt_redrafter.decoding.acceptance import Acceptance
from trt_redrafter.model.attention import AttentionMeta, causal_mask
from trt_redrafter.model.tp import Dist
from trt_redrafter.runtime.kv_cache import KVCacheFull, PagedKVCache
from trt_redrafter.runtime.state import SlotState
from trt_redrafter.runtime.step import DecodeStep


def make_cache(num_blocks=4, block_size=4, layers=2, max_slots=1, max_blocks_per_seq=4):
    return PagedKVCache(layers, num_blocks, block_size, kv_heads=1, head_size=2, dtype=torch.float32,
                        device=torch.device("cpu"), max_slots=max_slots, max_blocks_per_seq=max_blocks_per_seq)


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


def test_block_table_mirrors_bound_sequences_and_points_past_them_at_scratch():
    c = make_cache(num_blocks=4, block_size=4, max_slots=3, max_blocks_per_seq=3)
    c.reserve(1, 4)
    c.bind(1, slot=2)
    c.reserve(1, 6)  # a second block, mirrored into row 2
    c.sync()
    assert c.block_table[2].tolist() == c.blocks(1) + [c.scratch_block]
    assert c.block_table[0].tolist() == [c.scratch_block] * 3  # unused rows address the scratch block only
    c.free(1)
    c.sync()
    assert c.block_table[2].tolist() == [c.scratch_block] * 3


def test_rewind_moves_the_accepted_path_down_in_every_layer():
    """DecodeStep.rewind: committed context 3, tree written at 3..10, accepted path packed [0, 2, 5, 7]."""
    c = make_cache(num_blocks=4, block_size=4, max_slots=2, max_blocks_per_seq=4)
    c.reserve(1, 12)
    c.bind(1, slot=0)
    c.sync()
    slots = c.slots(1, 0, 12)
    for li in range(2):
        c.k[li][slots] = torch.arange(12, dtype=torch.float32)[:, None, None].expand(12, 1, 2) + 100 * li
        c.v[li][slots] = -c.k[li][slots]
    state = SlotState.allocate(2, num_beams=2, draft_len=3, device=torch.device("cpu"))
    state.ctx_len[0] = 3
    state.unpacker[0] = torch.tensor([[0, 1, 3, 4], [0, 2, 5, 7]])  # beam 1's packed path
    step = DecodeStep(model=None, proposer=None, cache=c, state=state, dist=Dist(0, 1, torch.device("cpu")))
    decision = Acceptance(torch.tensor([1]), torch.tensor([3]), torch.tensor([9])).pack()
    path = step.rewind(torch.tensor([0]), decision)
    assert path.tolist() == [[0, 2, 5, 7]] and state.ctx_len[0] == 3 + 4 and state.true_tok[0] == 9
    for li in range(2):
        got = c.k[li][slots][:, 0, 0].tolist()
        assert got[:7] == [100 * li + x for x in [0, 1, 2, 3, 5, 8, 10]]
        assert torch.equal(c.v[li][slots[:7]], -c.k[li][slots[:7]])


def test_attention_meta_masks_context_tree_and_padding():
    bs, T, block = 2, 3, 4
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # root with two children
    meta = AttentionMeta(positions=torch.tensor([[0, 1, 2], [2, 3, 3]]), write_slots=torch.zeros(bs, T, dtype=torch.long),
                         block_table=torch.tensor([[0, 1], [2, 3]]), ctx_len=torch.tensor([0, 2]),
                         tree_mask=torch.stack([causal_mask(3), tree]), block_size=block).for_torch()
    assert meta.kv_slots.tolist() == [list(range(0, 8)), list(range(8, 16))]
    m = meta.visible[:, 0]  # [bs, T, S]
    assert m[0, :, :3].tolist() == causal_mask(3).tolist()
    assert not m[0, :, 3:].any()
    assert m[1, :, :2].all()  # committed context visible to every tree token
    assert m[1, :, 2:5].tolist() == tree.tolist()
    assert not m[1, :, 5:].any()  # nothing past the tree
