"""Dynamic tree attention: turn the drafter's beams into one packed, prefix-deduplicated token tree.

The method is the paper's (ReDrafter, arXiv 2403.09919, section 3.3 and Appendix A.1): every beam has the same
length, so shared prefixes are found with one dense pairwise comparison instead of a trie, and everything after it
(packing, unpacking, the tree mask) is gathers and scatters. Apple's `tree_attention.py` and TensorRT-LLM's
`_beams2tree` compute the same objects; this is an independent implementation of that method.

Glossary:
    beams          [bs, nb, bl] token ids; column 0 is the true token (the same in every beam of a row), columns
                   1..dl are drafted tokens.
    beam position  (i, j): beam i, depth j (0 = the true token); flat index i*bl + j.
    prefix_tree    [bs, nb, bl]; prefix_tree[b, i, j] = smallest k with beams[b, k, :j+1] == beams[b, i, :j+1]. A
                   beam position is a tree node's first occurrence iff prefix_tree[b, i, j] == i.
    packed row     the unique tree nodes of one request in the paper's order: row-major over (i, j), keeping first
                   occurrences. A node's ancestors are at smaller depth in a beam with index <= i, so every ancestor
                   precedes its descendants, and a path's packed indices are strictly increasing.
    unpacker       [bs, nb, bl] packed index of every beam position: `tokens.gather(1, unpacker.flatten(1))`
                   rebuilds the beams, and the same gather takes any per-packed-token output (logits, hidden
                   states, KV) back to beam layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def up_to(n: int, device: torch.device) -> torch.Tensor:
    """[n, n] bool: [j, k] = k <= j. A running product, sum, minimum or "any" over a short static dimension, written
    as a reduction over this mask (`(x[..., None, :] | ~up_to(n)).all(-1)` for a running "all"), is exact and
    compiles into the step's fused kernels, where the scan itself (cumprod, cumsum, cummin) or a sort is a library
    call of its own on the CPU (docs/perf-history.md, "The tree step's scans as reductions")."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


def running_all(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] bool -> [..., n]: [..., j] = x[..., :j + 1].all() (a running product, as a reduction)."""
    return (x[..., None, :] | ~up_to(x.shape[-1], x.device)).all(dim=-1)


def dedup_prefix(beams: torch.Tensor) -> torch.Tensor:
    """prefix_tree[b, i, j] = smallest k such that beams[b, k, :j+1] == beams[b, i, :j+1] (paper, Listing 1).

    The paper's `matches[i][j][k]` compares token k of beam i with token k of beam j (across beams); a running
    product over depth (here: "all" over depths up to j) turns per-token equality into prefix equality.
    """
    assert beams.dim() == 3, f"beams must be [bs, nb, bl], got shape {tuple(beams.shape)}"
    bs, nb, bl = beams.shape
    same_token = beams[:, :, None, :] == beams[:, None, :, :]  # [bs, nb(i), nb(k), bl]
    same_prefix = running_all(same_token)  # [bs, nb, nb, bl]
    k_index = torch.arange(nb, device=beams.device).view(1, 1, nb, 1)
    # k = i always matches, so the minimum is <= i; non-matching k are pushed past the end.
    return torch.where(same_prefix, k_index, nb).amin(dim=2)  # [bs, nb, bl]


@dataclass
class PackedTree:
    """The packed draft tree of a batch; see the module glossary. P = the most packed tokens of any row."""

    tokens: torch.Tensor  # [bs, P] packed token ids; positions >= lengths[b] hold a valid filler (the true token)
    lengths: torch.Tensor  # [bs] packed tokens per row, 1 <= lengths <= 1 + nb*dl
    beam_positions: torch.Tensor  # [bs, P] flat beam position i*bl + j of each packed token (padding: 0)
    position_offsets: torch.Tensor  # [bs, P] depth j of each packed token (padding: 0); RoPE position = base + j
    unpacker: torch.Tensor  # [bs, nb, bl] packed index of each beam position
    mask: torch.Tensor  # [bs, P, P] bool; [b, p, q]: q is p or an ancestor of p (padding: diagonal only)

    @property
    def num_beams(self) -> int:
        return self.unpacker.shape[1]

    @property
    def beam_length(self) -> int:
        return self.unpacker.shape[2]

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """Per-packed-token values [bs, P, ...] -> beam layout [bs, nb, bl, ...] (e.g. verify logits)."""
        assert packed.shape[:2] == self.tokens.shape, \
            f"packed values {tuple(packed.shape)} do not start with [bs, P] = {tuple(self.tokens.shape)}"
        return unpack(self.unpacker, packed)


def unpack(unpacker: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """unpacker [bs, nb, bl], per-packed-token values [bs, P', ...] (P' >= the packed length) -> [bs, nb, bl, ...]."""
    bs, nb, bl = unpacker.shape
    tail = packed.shape[2:]
    index = unpacker.reshape(bs, nb * bl, *([1] * len(tail))).expand(bs, nb * bl, *tail)
    return packed.gather(1, index).reshape(bs, nb, bl, *tail)


def pack_beams(beams: torch.Tensor, pad_to: int | None = None) -> PackedTree:
    """Deduplicate shared prefixes of `beams` [bs, nb, bl] into a PackedTree (no loops over tokens).

    P is the longest row's packed length, or `pad_to` (>= 1 + nb*(bl-1), the most any row can have) for a static
    shape: then nothing here reads a value back to the host, so the packer runs inside a compiled step.
    """
    bs, nb, bl = beams.shape
    device = beams.device
    prefix_tree = dedup_prefix(beams)  # [bs, nb, bl]
    beam_ids = torch.arange(nb, device=device).view(1, nb, 1)
    keep = (prefix_tree == beam_ids).reshape(bs, nb * bl)  # [bs, nb*bl] first occurrences

    lengths = keep.sum(dim=1)  # [bs]
    if pad_to is None:
        assert bool(keep[:, 0].all()), "position (0, 0) must always be a first occurrence"
        P = int(lengths.max())
    else:
        assert pad_to >= 1 + nb * (bl - 1), f"pad_to={pad_to} < the largest possible tree 1 + nb*dl = {1 + nb * (bl - 1)}"
        P = pad_to
    # Packed index of every kept beam position: its rank among kept positions in row-major order.
    rank = (keep[:, None, :] & up_to(nb * bl, device)).sum(dim=2) - 1  # [bs, nb*bl]: kept positions up to each
    flat = torch.arange(nb * bl, device=device).expand(bs, nb * bl)
    # Scatter kept positions to their rank; dropped ones go to a discard column past the end.
    slot = torch.where(keep, rank, nb * bl)
    beam_positions = torch.zeros(bs, max(nb * bl, P) + 1, dtype=torch.long, device=device)
    beam_positions.scatter_(1, slot, flat)
    beam_positions = beam_positions[:, :P]  # [bs, P]
    valid = torch.arange(P, device=device)[None, :] < lengths[:, None]  # [bs, P]
    beam_positions = torch.where(valid, beam_positions, 0)

    tokens = beams.reshape(bs, nb * bl).gather(1, beam_positions)  # [bs, P]; padding reads (0, 0)
    position_offsets = beam_positions % bl  # [bs, P]; padding: 0

    # A beam position is packed where its first occurrence (prefix_tree[i, j], j) is.
    depth = torch.arange(bl, device=device).view(1, 1, bl)
    first_flat = prefix_tree * bl + depth  # [bs, nb, bl]
    unpacker = rank.gather(1, first_flat.reshape(bs, nb * bl)).reshape(bs, nb, bl)  # [bs, nb, bl]

    # Ancestors-or-self of beam position (i, j) are the packed tokens of (i, 0..j).
    node = unpacker[:, :, None, :, None] == torch.arange(P, device=device)  # [bs, nb, 1, bl(k), P]: (i, k)'s node
    beam_mask = (node & up_to(bl, device)[:, :, None]).any(dim=3)  # [bs, nb, bl(j), P]: some k <= j on it
    mask = beam_mask.reshape(bs, nb * bl, P).gather(
        1, beam_positions.unsqueeze(-1).expand(bs, P, P))  # [bs, P, P]
    eye = torch.eye(P, dtype=torch.bool, device=device).expand(bs, P, P)
    mask = (mask & valid[:, :, None] & valid[:, None, :]) | eye
    return PackedTree(tokens=tokens, lengths=lengths, beam_positions=beam_positions,
                      position_offsets=position_offsets, unpacker=unpacker, mask=mask)


def path_packed_indices(unpacker: torch.Tensor, beam_index: torch.Tensor,
                        num_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed indices of the first `num_tokens` positions of beam `beam_index`, per row (for the KV rewind).

    Returns (indices [bs, bl], lengths [bs]); entries at positions >= lengths[b] are 0 (the true token's slot, a
    valid index). Valid indices are strictly increasing, so copying KV entries in order from packed slot
    indices[t] to slot t never overwrites a source that is still to be read.
    """
    bs, nb, bl = unpacker.shape  # a PackedTree's `unpacker`
    assert beam_index.shape == (bs,) and num_tokens.shape == (bs,), \
        f"beam_index {tuple(beam_index.shape)} and num_tokens {tuple(num_tokens.shape)} must be [bs]=[{bs}]"
    if num_tokens.device.type == "cpu" and not torch.compiler.is_compiling():  # a check that costs no device sync
        assert bool(((num_tokens >= 1) & (num_tokens <= bl)).all()), \
            f"num_tokens must lie in [1, bl={bl}], got {num_tokens.tolist()}"
    rows = torch.arange(bs, device=beam_index.device)
    path = unpacker[rows, beam_index]  # [bs, bl]
    valid = torch.arange(bl, device=path.device)[None, :] < num_tokens[:, None]
    return torch.where(valid, path, 0), num_tokens.clone()


def node_scores(tree: PackedTree, scores: torch.Tensor, pad: float) -> torch.Tensor:
    """The proposer's score of every packed node: scores [bs, nb, dl] (a beam's prefix up to each drafted position)
    -> [bs, P]; the root scores 0 and padding `pad`. A node takes the score of its first occurrence, capped by its
    parent's (a beam search gives one prefix one score; this makes it so whatever the proposer returned, and a node
    never outranks its parent, which `order_by_score` relies on)."""
    bs, P = tree.tokens.shape
    nb, bl = tree.num_beams, tree.beam_length
    per_position = torch.cat([torch.zeros_like(scores[:, :, :1]), scores], dim=2).reshape(bs, -1)  # [bs, nb*bl]
    node = per_position.gather(1, tree.beam_positions)  # [bs, P] first occurrences
    along = node.gather(1, tree.unpacker.reshape(bs, nb * bl)).reshape(bs, nb, bl)  # each position's own score
    top = torch.finfo(along.dtype).max if along.is_floating_point() else torch.iinfo(along.dtype).max
    along = along[..., None, :].masked_fill(~up_to(bl, along.device), top).amin(dim=-1)  # the least along its path
    node = along.reshape(bs, nb * bl).gather(1, tree.beam_positions)
    valid = torch.arange(P, device=node.device)[None, :] < tree.lengths[:, None]
    return torch.where(valid, node, torch.full_like(node, pad))


def order_by_score(tree: PackedTree, score: torch.Tensor) -> tuple[PackedTree, torch.Tensor]:
    """Renumber the packed nodes best score first -> (the reordered tree, its scores [bs, P] in the new order).

    Ties go to the shallower node, then to the earlier one. A node never scores above its parent (a prefix's
    log-probability), so every ancestor still precedes its descendants: any first k nodes form a tree (the k best, as
    EAGLE-2 reranks), a path's indices still increase (the KV rewind's contract), and padding, scored lowest, stays
    last. Only the numbering changes: tokens, offsets and beam positions move with their node, the mask is permuted
    on both axes and the unpacker points at the new indices.
    """
    bs, P = tree.tokens.shape
    # a node's new index is how many nodes come before it: a higher score, or as high and shallower, or as high, as
    # deep and earlier (what a stable sort by depth, then a stable descending one by score, gives: see the test)
    s, d = score, tree.position_offsets
    idx = torch.arange(P, device=score.device)
    shallower = (d[:, None, :] < d[:, :, None]) | ((d[:, None, :] == d[:, :, None]) & (idx[None, :] < idx[:, None]))
    before = (s[:, None, :] > s[:, :, None]) | ((s[:, None, :] == s[:, :, None]) & shallower)  # [bs, P(node), P(other)]
    new_index = before.sum(dim=2)  # [bs, P], a permutation of 0..P-1
    order = torch.empty_like(new_index).scatter_(1, new_index, idx.expand(bs, P))
    nb, bl = tree.num_beams, tree.beam_length
    mask = tree.mask.gather(1, order[:, :, None].expand(bs, P, P)).gather(2, order[:, None, :].expand(bs, P, P))
    return PackedTree(tokens=tree.tokens.gather(1, order), lengths=tree.lengths,
                      beam_positions=tree.beam_positions.gather(1, order),
                      position_offsets=tree.position_offsets.gather(1, order),
                      unpacker=new_index.gather(1, tree.unpacker.reshape(bs, nb * bl)).reshape(bs, nb, bl),
                      mask=mask), score.gather(1, order)
