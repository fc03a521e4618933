"""The ReDrafter drafter head: `DrafterRank`, one TP rank of it for inference (TensorRT-LLM layout: every linear
column-parallel + all-gather), and `Drafter`, the same head as a trainable module (train-drafter).

Input: the base model's final-norm hidden state h at the last accepted position and a recurrent state s built
from the embeddings (the base model's table) of the tokens drafted so far.

    logits = lm_head(ResBlock^L(input_proj?([h ; s])))       ResBlock(x) = x + SiLU(W x + b)

State update, by `semantics`:
    "apple"        (default)  s0 = 0;  s' = SiLU(rnn_w e + rnn_u s)                      (rnn)
    "trtllm-0.13"             s' = rnn_w e  at step 0, rnn_w e + rnn_u s later
    without rnn, both use the cumulative embedding sum  s' = e + s.
"apple" is what Apple's trainer optimises and what TensorRT-LLM's ReDrafterForLLaMALM graph computes since 0.14
(PR #2297 "match Apple's ReDrafter v1.1": `_beam_search_candidates` in tensorrt_llm/models/redrafter/
redrafter_helper.py applies `silu(drafter.rnn_w(embedding(last_tokens)) + drafter.rnn_u(state))` from a zero state,
then `warp_logits` top-50), so TensorRT-LLM 1.0-1.2 engines draft the same beams. "trtllm-0.13" is the older graph
(`Drafter.rnn_embed`, no SiLU, no warp), kept to reproduce engines of those releases. Apple's top-50 warp of the
drafter logits lives in `decoding.beam_search` (runtime/proposer.py turns it on for "apple").

A drafter with a draft vocabulary (FR-Spec, arXiv 2502.14856; `cfg.draft_vocab_size` K > 0, this project's
extension) has an lm_head of K rows, one per token id of `draft_vocab`. `logits` still answers over the whole
vocabulary: the K scores go to their token ids, every other token gets LOG_ZERO, so the beam search, its kernels
and the `apple` acceptance (whose drafter distribution is then 0 outside the draft vocabulary) are unchanged and
verification stays exact; only the head's matrix (the drafter's largest read per step) shrinks by V / K.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..checkpoint.drafter import check_draft_vocab
from ..config import DRAFTER_SEMANTICS, DrafterConfig
from ..decoding.beam_search import LOG_ZERO
from ..errors import UserError
from ..checkpoint.quantization import quantize_per_channel
from .linear import Linear, QuantWeight
from .tp import Dist

SEMANTICS = DRAFTER_SEMANTICS


class DrafterRank(nn.Module):
    def __init__(self, cfg: DrafterConfig, tensors: dict[str, torch.Tensor], dist: Dist, dtype: torch.dtype,
                 semantics: str = "apple", linear: str = "torch", weights: str = ""):
        """`linear`: the linear layers' implementation, "torch", "onednn" or "avx512" (`linear.resolve_linear`).
        `weights`: "int8" quantizes every linear layer's weight to int8 per output channel (weight-only: the layer
        reads int8 and computes in `dtype`); "w8a8" too, and each layer's input is quantized to int8 per row and
        multiplied in bytes where the layers run the avx512 kernels on a CPU with VNNI (elsewhere as "int8"); "w4a8"
        as "w8a8" with the head's weight in int4 per output channel (elsewhere int4 weight-only); "" keeps them in
        `dtype`."""
        super().__init__()
        assert semantics in SEMANTICS, semantics
        assert weights in ("", "int8", "w8a8", "w4a8"), weights
        self.cfg, self.dist, self.dtype, self.semantics, self.linear = cfg, dist, dtype, semantics, linear
        self.weights = weights
        dev = dist.device

        def take(name: str) -> torch.Tensor:
            return tensors[f"drafter.{name}"].to(device=dev, dtype=dtype).contiguous()

        def weight(name: str) -> Union[torch.Tensor, QuantWeight]:
            if not weights:
                return take(name)
            # per output channel: a column-parallel rank holds whole rows, so its amax is the row's
            bits = 4 if weights == "w4a8" and name == "lm_head.weight" else 8
            q, s = quantize_per_channel(tensors[f"drafter.{name}"], bits, dtype)
            return QuantWeight(q.to(dev), s.to(dev), bits, q.shape[1], dtype, activations=weights in ("w8a8", "w4a8"))

        def lin(name: str, bias: bool = True) -> Linear:
            return Linear(weight(f"{name}.weight"), take(f"{name}.bias") if bias else None, impl=linear)

        self.input_proj = lin("input_proj") if cfg.has_input_proj else None  # [exit_dim/tp, 2H]
        # ResBlocks [exit_dim/tp, exit_dim] with bias
        self.layers = nn.ModuleList(lin(f"layers.{j}.linear") for j in range(cfg.num_draft_layers))
        self.lm_head = lin("lm_head", bias=False)  # [V/tp, exit_dim], or [K/tp, exit_dim] with a draft vocabulary
        # s' = f(rnn_w e + rnn_u s): rnn_w [H/tp, H], rnn_u [H/tp, H] with bias
        self.rnn = nn.ModuleList([lin("rnn_w", bias=False), lin("rnn_u")]) if cfg.rnn else None
        self.vocab_size = cfg.vocab_size
        # token id of each head row (replicated: the gathered head output is in this order); None: row = token id
        self.draft_vocab = _draft_vocab(tensors["drafter.draft_vocab"], cfg.vocab_size).to(dev) \
            if cfg.draft_vocab_size else None

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        """A column-parallel output, gathered (a replicated drafter's rank computed it whole)."""
        return x if self.cfg.replicated else self.dist.all_gather(x, dim=-1)

    def _col(self, x: torch.Tensor, linear: Linear) -> torch.Tensor:
        """Column-parallel linear with gathered output."""
        return self._gather(linear(x))

    # ---- the protocol `decoding.beam_search` drives ---------------------------------------------------------
    def init_state(self, n: int) -> torch.Tensor:
        return torch.zeros(n, self.cfg.hidden_size, dtype=self.dtype, device=self.dist.device)  # [n, H]

    def update_state(self, emb: torch.Tensor, state: torch.Tensor, step: int) -> torch.Tensor:
        """emb (the model's dtype), state: [n, H] -> next state [n, H]."""
        emb = emb.to(self.dtype)
        if self.rnn is None:
            return emb + state
        w, u = self.rnn
        if self.semantics == "trtllm-0.13":
            we = self._col(emb, w)
            return we if step == 0 else we + self._col(state, u)
        if step == 0:  # from Apple's zero state, where rnn_u(s) is its bias: the same sum, without reading rnn_u
            return F.silu(self._gather(w(emb) + u.bias))
        return F.silu(self._col(emb, w) + self._col(state, u))

    def logits(self, h: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """h, state: [n, H] -> float32 logits [n, V]."""
        head = self.head_logits(h, state)
        if self.draft_vocab is None:
            return head[:, :self.vocab_size]
        out = head.new_full((head.shape[0], self.vocab_size), LOG_ZERO)
        return out.index_copy_(1, self.draft_vocab, head)  # [n, V]: LOG_ZERO outside the draft vocabulary

    def head_logits(self, h: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """h, state: [n, H] -> float32 logits [n, head rows]: over the draft vocabulary's K ids (in `draft_vocab`
        order) where the drafter has one, else over the (padded) vocabulary."""
        x = torch.cat([h.to(self.dtype), state], dim=-1)  # [n, 2H]
        if self.input_proj is not None:
            x = self._col(x, self.input_proj)  # [n, exit_dim]
        for layer in self.layers:
            x = x + F.silu(self._col(x, layer))
        return self._col(x, self.lm_head).float()


def _draft_vocab(stored: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The engine's draft vocabulary as int64 token ids. build-engine before 2bae11d cast it with the weights to the
    engine's dtype: exact in float32, but bfloat16 / float16 round ids to repeated values; such an engine is refused
    with what to do."""
    ids = stored.to(torch.long).contiguous()
    try:
        check_draft_vocab(ids, vocab_size, "the engine's drafter.draft_vocab")
    except UserError as e:
        raise UserError(f"{e} It is stored as {stored.dtype}: an older build-engine cast the token ids to the "
                        f"engine's dtype. Rebuild the engine with build-engine.") from None
    return ids


# ---- the trainable drafter (train-drafter) ---------------------------------------------------------------------

class ResBlock(nn.Module):
    """x + SiLU(W x + b), trainable."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        nn.init.zeros_(self.linear.weight)  # starts as the identity (x + SiLU(0) = x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class Drafter(nn.Module):
    """Apple's drafter as a trainable module (TP 1, "apple" semantics, every row of the head): what `train-drafter`
    optimises (training/loop.py) and writes. `state_dict()` names are the Apple checkpoint names, which
    `checkpoint.drafter` reads back for `DrafterRank`."""

    def __init__(self, hidden_size: int, vocab_size: int, exit_dim: int, num_layers: int, rnn: bool,
                 draft_vocab: Optional[torch.Tensor] = None):
        """`draft_vocab` [K] (token ids): the head has K rows, one per id (a buffer, saved as `draft_vocab`)."""
        super().__init__()
        self.hidden_size, self.vocab_size, self.exit_dim, self.num_layers, self.rnn = (
            hidden_size, vocab_size, exit_dim, num_layers, rnn)
        if exit_dim != 2 * hidden_size:
            self.input_proj = nn.Linear(2 * hidden_size, exit_dim)
        rows = vocab_size if draft_vocab is None else len(draft_vocab)
        self.lm_head = nn.Sequential(*[ResBlock(exit_dim) for _ in range(num_layers)],
                                     nn.Linear(exit_dim, rows, bias=False))
        if draft_vocab is not None:
            self.register_buffer("draft_vocab", draft_vocab.to(torch.long).clone())
        if rnn:
            self.rnn_u = nn.Linear(hidden_size, hidden_size, bias=True)
            self.rnn_w = nn.Linear(hidden_size, hidden_size, bias=False)

    def update_state(self, emb: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        if not self.rnn:
            return emb + state
        return F.silu(self.rnn_w(emb) + self.rnn_u(state))

    def logits(self, h: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        x = torch.cat([h, state], dim=-1)  # [..., 2H]
        if hasattr(self, "input_proj"):
            x = self.input_proj(x)
        return self.lm_head(x)

    def forward(self, h: torch.Tensor, embs: torch.Tensor) -> torch.Tensor:
        """h [B, H], embs [B, T, H] (embeddings of the consumed tokens) -> logits [B, T, V] (or [B, T, K]: head
        rows, in `draft_vocab` order)."""
        state = torch.zeros_like(h)
        out = []
        for i in range(embs.shape[1]):
            state = self.update_state(embs[:, i], state)
            out.append(self.logits(h, state))
        return torch.stack(out, dim=1)
