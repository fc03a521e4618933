"""Golden and property tests for beams -> packed tree (paper section 3.3, Appendix A.1)."""

import torch

from trt_redrafter.decoding.tree import PackedTree, dedup_prefix, pack_beams, path_packed_indices

# Figure 4: three beams of five tokens; beam 1 shares 3 tokens with beam 0, beam 2 shares 4 with beam 1.
FIG4 = torch.tensor([[10, 11, 12, 13, 14],
                     [10, 11, 12, 15, 16],
                     [10, 11, 12, 15, 17]])


def brute_force_tree(beams: torch.Tensor):
    """Per row: packed node list [(i, j)] in the paper's order and the ancestor-or-self relation, by loops."""
    nb, bl = beams.shape
    rows = beams.tolist()
    nodes, where = [], {}
    for i in range(nb):
        for j in range(bl):
            key = tuple(rows[i][:j + 1])
            if key not in where:
                where[key] = len(nodes)
                nodes.append((i, j))
    n = len(nodes)
    anc = [[False] * n for _ in range(n)]
    for p, (i, j) in enumerate(nodes):
        for q, (k, l) in enumerate(nodes):
            anc[p][q] = l <= j and rows[k][:l + 1] == rows[i][:l + 1]
    unpacker = [[where[tuple(rows[i][:j + 1])] for j in range(bl)] for i in range(nb)]
    return nodes, anc, unpacker


def check_invariants(beams: torch.Tensor, tree: PackedTree) -> None:
    bs, nb, bl = beams.shape
    P = tree.tokens.shape[1]
    assert torch.equal(tree.tokens.gather(1, tree.unpacker.reshape(bs, -1)).reshape(bs, nb, bl), beams)
    assert torch.equal(tree.unpack(tree.tokens), beams)
    for b in range(bs):
        nodes, anc, unpacker = brute_force_tree(beams[b])
        n = len(nodes)
        assert int(tree.lengths[b]) == n
        assert tree.unpacker[b].tolist() == unpacker
        assert tree.beam_positions[b, :n].tolist() == [i * bl + j for i, j in nodes]
        assert tree.position_offsets[b, :n].tolist() == [j for _, j in nodes]
        assert tree.mask[b, :n, :n].tolist() == anc
        # padding: filler is the true token, offsets 0, mask diagonal only
        assert (tree.tokens[b, n:] == beams[b, 0, 0]).all()
        assert (tree.beam_positions[b, n:] == 0).all() and (tree.position_offsets[b, n:] == 0).all()
        assert not tree.mask[b, n:, :n].any() and not tree.mask[b, :n, n:].any()
        assert torch.equal(tree.mask[b, n:, n:], torch.eye(P - n, dtype=torch.bool))


def test_dedup_prefix_listing1():
    beams = torch.tensor([[[91, 92, 93, 95], [91, 92, 94, 96], [91, 92, 93, 97]]])
    expected = [[0, 0, 0, 0], [0, 0, 1, 1], [0, 0, 0, 2]]
    assert dedup_prefix(beams)[0].tolist() == expected


def test_pack_figure4_golden():
    tree = pack_beams(FIG4[None])
    assert tree.tokens.tolist() == [[10, 11, 12, 13, 14, 15, 16, 17]]  # 15 tokens -> 8
    assert tree.lengths.tolist() == [8]
    assert tree.beam_positions.tolist() == [[0, 1, 2, 3, 4, 8, 9, 14]]
    assert tree.position_offsets.tolist() == [[0, 1, 2, 3, 4, 3, 4, 4]]
    assert tree.unpacker.tolist() == [[[0, 1, 2, 3, 4], [0, 1, 2, 5, 6], [0, 1, 2, 5, 7]]]
    mask = [[1, 0, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0, 0, 0],
            [1, 1, 1, 1, 0, 0, 0, 0],
            [1, 1, 1, 1, 1, 0, 0, 0],
            [1, 1, 1, 0, 0, 1, 0, 0],
            [1, 1, 1, 0, 0, 1, 1, 0],
            [1, 1, 1, 0, 0, 1, 0, 1]]
    assert tree.mask.int().tolist() == [mask]
    check_invariants(FIG4[None], tree)


def test_pack_batch_with_different_lengths():
    same = torch.tensor([[7, 1, 2, 3, 4]] * 3)
    beams = torch.stack([FIG4, same])
    tree = pack_beams(beams)
    assert tree.lengths.tolist() == [8, 5]
    assert tree.tokens.shape == (2, 8)
    assert tree.tokens[1].tolist() == [7, 1, 2, 3, 4, 7, 7, 7]
    assert tree.unpacker[1].tolist() == [[0, 1, 2, 3, 4]] * 3
    check_invariants(beams, tree)


def test_pack_single_beam_is_a_chain():
    beams = torch.tensor([[[5, 6, 7, 8]], [[1, 1, 1, 1]]])
    tree = pack_beams(beams)
    assert tree.lengths.tolist() == [4, 4]
    assert torch.equal(tree.mask[0], torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    check_invariants(beams, tree)


def test_pack_all_distinct_after_root():
    beams = torch.tensor([[[9, 1, 2], [9, 3, 4], [9, 5, 6], [9, 7, 8]]])
    tree = pack_beams(beams)
    assert tree.lengths.tolist() == [1 + 4 * 2]
    assert tree.tokens.tolist() == [[9, 1, 2, 3, 4, 5, 6, 7, 8]]
    assert tree.unpacker.tolist() == [[[0, 1, 2], [0, 3, 4], [0, 5, 6], [0, 7, 8]]]
    check_invariants(beams, tree)


def test_pack_repeated_token_at_different_depths_is_not_merged():
    # Same token at the same depth but under different parents stays two nodes.
    beams = torch.tensor([[[0, 1, 2, 3], [0, 2, 2, 3], [0, 1, 2, 4]]])
    tree = pack_beams(beams)
    assert tree.unpacker.tolist() == [[[0, 1, 2, 3], [0, 4, 5, 6], [0, 1, 2, 7]]]
    check_invariants(beams, tree)


def test_pack_property_random_small_vocab():
    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        bs = int(torch.randint(1, 4, (1,), generator=g))
        nb = int(torch.randint(1, 7, (1,), generator=g))
        bl = int(torch.randint(1, 6, (1,), generator=g))
        V = int(torch.randint(2, 4, (1,), generator=g))
        beams = torch.randint(0, V, (bs, nb, bl), generator=g)
        beams[:, :, 0] = beams[:, :1, 0]  # every beam of a row starts with the same true token
        tree = pack_beams(beams)
        check_invariants(beams, tree)
        # ancestors precede descendants: the mask is lower triangular
        assert torch.equal(tree.mask, tree.mask.tril())


def test_path_packed_indices():
    tree = pack_beams(torch.stack([FIG4, FIG4]))
    idx, n = path_packed_indices(tree.unpacker, torch.tensor([2, 1]), torch.tensor([5, 3]))
    assert idx.tolist() == [[0, 1, 2, 5, 7], [0, 1, 2, 0, 0]]
    assert n.tolist() == [5, 3]
    idx, n = path_packed_indices(tree.unpacker, torch.tensor([0, 1]), torch.tensor([1, 4]))
    assert idx.tolist() == [[0, 0, 0, 0, 0], [0, 1, 2, 5, 0]]


# ---- the step's running reductions against the scans and sorts they replace (bit for bit) ----------------------

def _dedup_by_cumprod(beams: torch.Tensor) -> torch.Tensor:
    nb = beams.shape[1]
    same_prefix = torch.cumprod((beams[:, :, None, :] == beams[:, None, :, :]).to(torch.int32), dim=-1).bool()
    return torch.where(same_prefix, torch.arange(nb).view(1, 1, nb, 1), nb).amin(dim=2)


def _order_by_sorts(tree: PackedTree, score: torch.Tensor) -> torch.Tensor:
    by_depth = torch.sort(tree.position_offsets, dim=1, stable=True).indices
    return by_depth.gather(1, torch.sort(score.gather(1, by_depth), dim=1, descending=True, stable=True).indices)


def test_running_reductions_equal_the_scans_and_sorts_they_replace():
    """dedup_prefix, the packed ranks, node_scores' running minimum, order_by_score and the accepted prefix length
    are reductions over `up_to` masks (they compile into the step's kernels); each equals the cumprod / cumsum /
    cummin / stable sort it replaces, on random trees with many shared prefixes and tied scores."""
    from trt_redrafter.decoding.acceptance import _leading_true
    from trt_redrafter.decoding.tree import node_scores, order_by_score

    g = torch.Generator().manual_seed(1)
    for trial in range(80):
        bs, nb, bl = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((1, 4), (1, 7), (2, 6)))
        beams = torch.randint(0, 3, (bs, nb, bl), generator=g)
        beams[:, :, 0] = beams[:, :1, 0]
        assert torch.equal(dedup_prefix(beams), _dedup_by_cumprod(beams))
        P = 1 + nb * (bl - 1)
        tree = pack_beams(beams, pad_to=P + int(torch.randint(0, 3, (1,), generator=g)))
        keep = (dedup_prefix(beams) == torch.arange(nb).view(1, nb, 1)).reshape(bs, -1)
        ranks = tree.unpacker.reshape(bs, -1).gather(1, torch.arange(nb * bl).expand(bs, -1))
        assert torch.equal(ranks[keep], (torch.cumsum(keep, dim=1) - 1)[keep])
        scores = -torch.randint(0, 4, (bs, nb, bl - 1), generator=g) * 1024  # few values: many ties
        node = node_scores(tree, scores, -99999)
        per_position = torch.cat([torch.zeros_like(scores[:, :, :1]), scores], dim=2).reshape(bs, -1)
        first = per_position.gather(1, tree.beam_positions)
        along = first.gather(1, tree.unpacker.reshape(bs, -1)).reshape(bs, nb, bl).cummin(dim=2).values
        valid = torch.arange(tree.tokens.shape[1])[None, :] < tree.lengths[:, None]
        expect = torch.where(valid, along.reshape(bs, -1).gather(1, tree.beam_positions), -99999)
        assert torch.equal(node, expect)
        ordered, by = order_by_score(tree, node)
        order = _order_by_sorts(tree, node)
        assert torch.equal(ordered.tokens, tree.tokens.gather(1, order)) and torch.equal(by, node.gather(1, order))
        assert torch.equal(ordered.beam_positions, tree.beam_positions.gather(1, order))
        ok = torch.rand(bs, nb, bl, generator=g) < 0.7
        assert torch.equal(_leading_true(ok), torch.cumprod(ok.to(torch.int32), dim=-1).sum(dim=-1).long())
