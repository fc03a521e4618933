"""Beams -> packed draft tree in one kernel: prefix dedup, ranks, unpacker, packed tokens/depths, ancestor mask.

Oracle: `decoding.tree.pack_beams(beams, pad_to=P)` (same PackedTree, exactly). One program per request; a
request's nb x bl beam positions (at most a few dozen) sit in registers, and every gather of the oracle becomes a
one-hot reduction over that small tile, so nothing leaves the program until the outputs are stored.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..decoding.tree import PackedTree


@triton.jit
def _pack_kernel(beams_ptr, tokens_ptr, offsets_ptr, positions_ptr, mask_ptr, unpacker_ptr, lengths_ptr,
                 NB, BL, P, NB_PAD: tl.constexpr, BL_PAD: tl.constexpr, P_PAD: tl.constexpr):
    F: tl.constexpr = NB_PAD * BL_PAD
    b = tl.program_id(0)
    i = tl.arange(0, NB_PAD)[:, None]
    j = tl.arange(0, BL_PAD)[None, :]
    valid = (i < NB) & (j < BL)
    tok = tl.load(beams_ptr + b * NB * BL + i * BL + j, mask=valid, other=-1)  # [NB_PAD, BL_PAD]

    # prefix_tree[i, j] = smallest k with beams[k, :j+1] == beams[i, :j+1]   ([i, k, j] tiles)
    k3 = tl.arange(0, NB_PAD)[None, :, None]
    differs = tl.where(tok[:, None, :] != tok[None, :, :], 1, 0)
    same_prefix = tl.cumsum(differs, axis=2) == 0
    prefix = tl.min(tl.where(same_prefix & (k3 < NB), k3, NB_PAD), axis=1)  # [NB_PAD, BL_PAD]
    keep = tl.where((prefix == i) & valid, 1, 0)  # first occurrences

    # rank of every kept position in row-major order = its packed index
    keep_flat = tl.reshape(keep, [F])
    rank_flat = tl.cumsum(keep_flat, axis=0) - 1
    rank = tl.reshape(rank_flat, [NB_PAD, BL_PAD])
    length = tl.sum(keep_flat, axis=0)
    tl.store(lengths_ptr + b, length.to(tl.int64))

    # unpacker[i, j] = rank[prefix[i, j], j]
    unp = tl.sum(tl.where(prefix[:, None, :] == k3, rank[None, :, :], 0), axis=1)  # [NB_PAD, BL_PAD]
    tl.store(unpacker_ptr + b * NB * BL + i * BL + j, unp.to(tl.int64), mask=valid)

    # packed token p <- the kept position whose rank is p
    p = tl.arange(0, P_PAD)
    f = tl.arange(0, F)[None, :]
    hit = (keep_flat[None, :] == 1) & (rank_flat[None, :] == p[:, None])  # [P_PAD, F]
    tok_p = tl.sum(tl.where(hit, tl.reshape(tok, [F])[None, :], 0), axis=1)
    i_p = tl.sum(tl.where(hit, f // BL_PAD, 0), axis=1)
    j_p = tl.sum(tl.where(hit, f % BL_PAD, 0), axis=1)
    p_ok = p < length
    root = tl.load(beams_ptr + b * NB * BL)
    out = p < P
    tl.store(tokens_ptr + b * P + p, tl.where(p_ok, tok_p, root).to(tl.int64), mask=out)
    tl.store(offsets_ptr + b * P + p, tl.where(p_ok, j_p, 0).to(tl.int64), mask=out)
    tl.store(positions_ptr + b * P + p, tl.where(p_ok, i_p * BL + j_p, 0).to(tl.int64), mask=out)

    # mask[p, q]: q is one of beam i_p's nodes at depth <= j_p (ancestor or self)
    i3 = tl.arange(0, NB_PAD)[None, :, None]
    anc = tl.sum(tl.where(i_p[:, None, None] == i3, unp[None, :, :], 0), axis=1)  # [P_PAD, BL_PAD]
    anc_ok = (j <= j_p[:, None]) & (j < BL)
    q3 = tl.arange(0, P_PAD)[None, :, None]
    seen = tl.sum(tl.where(anc_ok[:, None, :] & (anc[:, None, :] == q3), 1, 0), axis=2) > 0  # [P_PAD, P_PAD]
    q = tl.arange(0, P_PAD)[None, :]
    m = (seen & p_ok[:, None] & (q < length)) | (p[:, None] == q)
    tl.store(mask_ptr + b * P * P + p[:, None] * P + q, m.to(tl.int1), mask=out[:, None] & (q < P))


def pack_beams(beams: torch.Tensor, pad_to: int) -> PackedTree:
    """beams [bs, nb, bl] int64 -> PackedTree padded to `pad_to` (>= 1 + nb*(bl-1)) packed tokens."""
    assert beams.dim() == 3 and beams.dtype == torch.long, \
        f"beams must be int64 [bs, nb, bl], got {beams.dtype} {tuple(beams.shape)}"
    bs, nb, bl = beams.shape
    assert pad_to >= 1 + nb * (bl - 1), f"pad_to={pad_to} < the largest possible tree 1 + nb*dl = {1 + nb * (bl - 1)}"
    beams = beams.contiguous()
    dev = beams.device
    P = pad_to
    tokens = torch.empty(bs, P, dtype=torch.long, device=dev)
    offsets = torch.empty_like(tokens)
    positions = torch.empty_like(tokens)
    mask = torch.empty(bs, P, P, dtype=torch.bool, device=dev)
    unpacker = torch.empty(bs, nb, bl, dtype=torch.long, device=dev)
    lengths = torch.empty(bs, dtype=torch.long, device=dev)
    _pack_kernel[(bs,)](beams, tokens, offsets, positions, mask, unpacker, lengths, nb, bl, P,
                        NB_PAD=max(2, triton.next_power_of_2(nb)), BL_PAD=max(2, triton.next_power_of_2(bl)),
                        P_PAD=max(2, triton.next_power_of_2(P)))
    return PackedTree(tokens=tokens, lengths=lengths, beam_positions=positions, position_offsets=offsets,
                      unpacker=unpacker, mask=mask)
