"""Per-request decoding state and statistics, passed in and out of `Engine.step`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..config import SamplingConfig
from ..decoding import tree


@dataclass
class Draft:
    """The packed draft tree a request verifies in its next step (one row of `decoding.tree.PackedTree`)."""

    beams: torch.Tensor  # [nb, bl] token 0 = the true token
    tokens: torch.Tensor  # [P] packed tree tokens
    mask: torch.Tensor  # [P, P] bool tree mask
    offsets: torch.Tensor  # [P] depth of each packed token
    unpacker: torch.Tensor  # [nb, bl] packed index of every beam position
    log_probs: Optional[torch.Tensor] = None  # [nb, dl, V] drafter log-probs (kept for `apple` acceptance only)


@dataclass
class SeqStats:
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    steps: int = 0  # generation steps after the prompt step
    generated_in_steps: int = 0  # tokens those steps emitted
    accepted_draft_tokens: int = 0
    draft_tokens: int = 0  # dl per ReDrafter step: the most a step can accept

    @property
    def tokens_per_step(self) -> float:
        return self.generated_in_steps / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0


@dataclass
class Sequence:
    seq_id: int
    prompt: list[int]
    sampling: SamplingConfig
    mode: str  # "redrafter" | "ar"
    stop_ids: frozenset[int]
    max_len: int  # prompt + output limit (engine max_seq_len)
    generator: torch.Generator
    stop_sequences: tuple[tuple[int, ...], ...] = ()  # multi-token stop words (TensorRT-LLM `stop_words`)
    output: list[int] = field(default_factory=list)
    ctx_len: int = 0  # committed KV entries
    pending: Optional[int] = None  # the true token: emitted, not yet in the KV cache (root of the next tree)
    draft: Optional[Draft] = None
    finished: bool = False
    finish_reason: Optional[str] = None  # "stop" | "length" | "cancelled"
    stats: SeqStats = field(default_factory=SeqStats)

    @property
    def in_prompt_phase(self) -> bool:
        return self.ctx_len == 0 and self.pending is None

    def append(self, tokens: list[int]) -> list[int]:
        """Append emitted tokens, applying stop tokens and max_tokens; returns what was actually appended."""
        out = []
        for t in tokens:
            if self.finished:
                break
            self.output.append(t)
            out.append(t)
            if t in self.stop_ids or any(len(q) <= len(self.output) and tuple(self.output[-len(q):]) == q
                                         for q in self.stop_sequences):
                self.finish("stop")
            elif len(self.output) >= self.sampling.max_tokens or len(self.prompt) + len(self.output) >= self.max_len:
                self.finish("length")
        return out

    def finish(self, reason: str) -> None:
        self.finished, self.finish_reason = True, reason
        self.stats.finish_time = time.perf_counter()
        self.draft = None


def attach_drafts(seqs: list[Sequence], beams: torch.Tensor, log_probs: torch.Tensor | None = None) -> None:
    """Pack beams [g, nb, bl] (row i belongs to seqs[i]) and give each sequence its draft tree for the next step.

    `log_probs` [g, nb, dl, V] is kept only for requests that use `apple` acceptance (the only rule that needs Q).
    """
    packed = tree.pack_beams(beams)
    for i, s in enumerate(seqs):
        n = int(packed.lengths[i])
        keep = log_probs is not None and s.sampling.resolved_acceptance == "apple"
        s.draft = Draft(beams=beams[i], tokens=packed.tokens[i, :n], mask=packed.mask[i, :n, :n],
                        offsets=packed.position_offsets[i, :n], unpacker=packed.unpacker[i],
                        log_probs=log_probs[i] if keep else None)
