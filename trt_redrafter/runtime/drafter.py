"""The device drafter: Apple's recurrent drafter's beam search over the drafter head, from the base model's hidden
state, run inside the compiled step (scores: the drafter's log-probabilities of the beam prefixes). Proposers that
draft on the device own one (proposer.py); the step runs it (step.py)."""

from __future__ import annotations

from typing import Callable, Optional, Protocol, Sequence, runtime_checkable

import torch

from .. import cpu
from ..decoding import beam_search
from ..decoding.beam_search import BeamSearchResult, SelectFn
from ..model.drafter import DrafterRank
from ..model.linear import Linear

APPLE_WARP_TOP_K = 50  # Apple's drafter keeps its 50 most likely tokens before the beam search


@runtime_checkable
class DeviceDrafter(Protocol):
    num_beams: int
    draft_len: int

    def draft(self, h: torch.Tensor, true_token: torch.Tensor, keep_log_probs: bool,
              beams: Optional[torch.Tensor] = None, depth_rows: Optional[Sequence[torch.Tensor]] = None
              ) -> BeamSearchResult:
        """h [bs, H] (final-norm hidden state at the last accepted position), true_token [bs] -> beams, scores;
        `beams` [k]: search k <= num_beams beams (None: num_beams). A tensor whose length counts, not an int: in a
        compiled step k is an unbacked size, which stays one where the step's graph breaks around this call.
        `depth_rows`: the search stops early (`decoding.beam_search`'s; None: it drafts draft_len tokens)."""


class BeamDrafter:
    """Apple's recurrent drafter: beam search over the drafter head, from the base model's hidden state.

    `embedding` (the base's input embedding table that `embed` reads): where given, the search runs in one CPU kernel
    where it can (`FusedSearch`); else, and wherever that does not apply, as `decoding.beam_search`."""

    def __init__(self, drafter: DrafterRank, embed: Callable[[torch.Tensor], torch.Tensor], num_beams: int,
                 draft_len: int, select: Optional[SelectFn] = None, embedding: Optional[torch.Tensor] = None):
        self.drafter, self.embed = drafter, embed
        self.num_beams, self.draft_len = num_beams, draft_len
        self.warp_top_k = APPLE_WARP_TOP_K if drafter.semantics == "apple" else None
        self.select = select or beam_search.select_beams_topk
        self.fused = FusedSearch.of(drafter, embedding, self.warp_top_k, num_beams) if embedding is not None \
            else None

    @property
    def path(self) -> str:
        """How the search runs, for bench-engine's header: one kernel call a step (where the acceptance rule reads no
        drafter distribution), or a call per layer and depth."""
        if self.fused is not None:
            return "one kernel call a step (cpu beam_draft)"
        return "a call per layer and depth (decoding.beam_search)"

    def draft(self, h: torch.Tensor, true_token: torch.Tensor, keep_log_probs: bool,
              beams: Optional[torch.Tensor] = None, depth_rows: Optional[Sequence[torch.Tensor]] = None
              ) -> BeamSearchResult:
        nb = self.num_beams if beams is None else beams.shape[0]
        if self.fused is not None and not keep_log_probs and h.dtype == self.fused.embedding.dtype:
            return self.fused(h, true_token, nb, self.num_beams, self.draft_len, depth_rows)
        # traced (the count an unbacked size): choose every path by the bound, never by the count
        bound = self.num_beams if beams is not None and torch.compiler.is_compiling() else None
        return beam_search.beam_search(self.drafter, self.embed, h, true_token, nb, self.draft_len,
                                       warp_top_k=self.warp_top_k, keep_log_probs=keep_log_probs,
                                       select=self.select, max_beams=bound, depth_rows=depth_rows)


class FusedSearch:
    """The drafter's whole beam search as one call of the CPU kernel `beam_draft` (cpu/draft.cpp): its layers in the
    same kernels the `Linear` modules call, then the top-k, the beams' selection and their bookkeeping, with no call
    per layer or per depth. The drafts are `beam_search`'s with `select_beams_topk` over `cpu.topk` (every sum and
    SiLU rounded where eager torch rounds it; the exp's last bit and the normalizer's order of summation aside:
    tests/test_cpu_draft.py). It applies where the rank holds the whole drafter (TP 1, or a replicated drafter) in
    float32 or bfloat16, with Apple's recurrent state, every layer in the avx512 kernels (float, or int8 / int4
    weights with int8 inputs), and a search whose candidates need no other path: no `apple` acceptance (its
    log-probabilities over the whole vocabulary), and Apple's top-50 warp keeping at least `num_beams` tokens and
    fewer than the drafter ranks."""

    def __init__(self, drafter: DrafterRank, embedding: torch.Tensor, warp_top_k: int, layers: list[Linear]):
        self.embedding = embedding
        self.warp = warp_top_k
        self.vocab = drafter.vocab_size
        self.ids = drafter.draft_vocab
        self.has_proj = drafter.input_proj is not None
        self.bf16 = drafter.dtype == torch.bfloat16
        none = torch.empty(0)
        self.weights: list[torch.Tensor] = []
        self.bits: list[int] = []
        for lin in layers:
            if lin.w8a8 is not None:
                colsum, scales, bias32, bits = lin.w8a8
                parts = [lin.packed, lin.bias, colsum, scales, bias32]
            else:
                bits, parts = 0, [lin.packed, lin.bias]
            self.weights += [none if t is None else t for t in parts] + [none] * (5 - len(parts))
            self.bits.append(bits)
        self.out_features = [lin.out_features for lin in layers]

    @staticmethod
    def of(drafter: DrafterRank, embedding: torch.Tensor, warp_top_k: Optional[int], num_beams: int
           ) -> Optional["FusedSearch"]:
        """The fused search for this drafter, or None where it does not apply (see the class)."""
        layers = [*(drafter.rnn or []), *([drafter.input_proj] if drafter.input_proj is not None else []),
                  *drafter.layers, drafter.lm_head]
        whole = drafter.cfg.replicated or drafter.dist.world_size == 1
        ranked = drafter.draft_vocab.shape[0] if drafter.draft_vocab is not None else drafter.vocab_size
        if not (embedding.device.type == "cpu" and whole and drafter.rnn is not None and drafter.semantics == "apple"
                and drafter.dtype in (torch.float32, torch.bfloat16)
                and embedding.dtype in (torch.float32, torch.bfloat16)
                and all(_avx512_layer(lin) for lin in layers)
                and warp_top_k is not None and num_beams <= warp_top_k < ranked):
            return None
        return FusedSearch(drafter, embedding, warp_top_k, layers)

    def __call__(self, h: torch.Tensor, true_token: torch.Tensor, num_beams, max_beams: int,
                 draft_len: int, depth_rows: Optional[Sequence[torch.Tensor]] = None) -> BeamSearchResult:
        """`depth_rows`: `beam_search`'s (the search stops before the first empty one; the kernel reads only their
        lengths); None: every depth."""
        beams, scores = torch.ops.trt_redrafter_cpu.beam_draft(
            h.contiguous(), true_token, self.embedding, self.weights, self.bits, self.out_features, self.has_proj,
            self.bf16, num_beams, max_beams, draft_len, self.warp, self.vocab, self.ids, list(depth_rows or ()))
        return BeamSearchResult(beams=beams, log_probs=None, scores=scores)


def _avx512_layer(lin: Linear) -> bool:
    """Whether a drafter layer runs this project's float or int8-input CPU kernel (what `beam_draft` calls)."""
    return (lin.impl == "avx512" and lin.packed is not None and lin.quant is None and lin.fp8 is None
            and lin.pre_scale is None and lin.input_scale is None and not lin.packed.is_cuda)
