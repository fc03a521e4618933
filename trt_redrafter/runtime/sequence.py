"""Per-request host state and statistics, passed in and out of `Engine.step`; and `RequestSpec`, what a request asks
for, the one form every layer carries it in.

What a step computes with (KV length, the next draft tree, sampling parameters) lives on the device in
`state.SlotState`, in the row of the request's batch slot; this is the host's side: the tokens emitted so far, stop
conditions, and a mirror of the committed KV length that the KV allocator and the scheduler read.
"""

from __future__ import annotations

import time
import dataclasses
from dataclasses import dataclass, field
from typing import Hashable, Optional

from ..config import AcceptanceRule, DecodingMode, Guide, SamplingConfig
from ..decoding.logprobs import TokenLogprob
from .grammar import GrammarState


@dataclass
class RequestSpec:
    """One request as the user asked for it: built once where it enters (`generate`, the Triton model's inputs, which
    the OpenAI frontend sends too, a corpus generator) and carried unchanged by the scheduler's `Request`, the TP step
    plan (`PlannedRequest`) and the engine's `Sequence`."""

    prompt: list[int]
    params: SamplingConfig
    mode: DecodingMode = DecodingMode.TREE  # AR: one token per step (the wire names parse: DecodingMode("ar"))
    proposer: Optional[str] = None  # redrafter | ngram | mixed (config.PROPOSERS); None: the engine's default
    stop_ids: tuple[int, ...] = ()
    stop_sequences: tuple[tuple[int, ...], ...] = ()  # multi-token stop words (TensorRT-LLM `stop_words`)
    cache_salt: str = ""  # prefix reuse only among requests with the same salt (vLLM's `cache_salt`; kv_cache.py)
    guide: Optional[Guide] = None  # the grammar its output follows (structured output; runtime/grammar.py)


@dataclass
class StepEvent:
    """What one step did for one request (streamed to clients)."""

    seq_id: Hashable  # the request's id (Request.request_id), or the engine's own count
    new_tokens: list[int]
    finished: bool


@dataclass
class SeqStats:
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    steps: int = 0  # generation steps after the prompt step
    generated_in_steps: int = 0  # tokens those steps emitted
    accepted_draft_tokens: int = 0
    draft_tokens: int = 0  # per tree step, the most it could accept: the depth of the deepest node it verified
    cached_tokens: int = 0  # prompt tokens whose K/V its (last) prompt step reused from the cache (prefix reuse)
    kv_reused_blocks: int = 0  # KV blocks it took from the prefix cache

    @property
    def tokens_per_step(self) -> float:
        return self.generated_in_steps / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0


@dataclass
class TreeNodes:
    """A request's next draft tree, node by node as the step numbers them (best first, the root first): each node's
    quantized score (step.quantize_scores) and depth, and for a tree the device drafted the lowest beam through it
    (empty for trees composed on the host)."""

    scores: list[int]
    depths: list[int]
    beams: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.scores)

    @classmethod
    def of_positions(cls, scores: list[int], positions: list[int], beam_length: int) -> "TreeNodes":
        """From a packed tree's node scores and first beam positions i * bl + j (`DecodeStep.pack`)."""
        return cls(scores, [p % beam_length for p in positions], [p // beam_length for p in positions])


@dataclass
class Draft:
    """A tree as nb beams: rows [nb][bl] (column 0 the true token) and scores [nb][dl] (quantized log-confidence of
    each row's prefix up to each drafted token)."""

    rows: list[list[int]]
    scores: list[list[int]]

    def nodes(self) -> TreeNodes:
        """The packed tree's nodes, best first as the step numbers them (root first): each distinct prefix once,
        scored by its first row and never above its parent (`tree.node_scores`)."""
        seen: dict[tuple[int, ...], int] = {}
        for row, sc in zip(self.rows, self.scores):
            parent = 0
            for j in range(1, len(row)):
                key = tuple(row[1:j + 1])
                if key not in seen:
                    seen[key] = min(sc[j - 1], parent)
                parent = seen[key]
        nodes = sorted(((s, len(k)) for k, s in seen.items()), key=lambda x: (-x[0], x[1]))
        return TreeNodes([0] + [s for s, _ in nodes], [0] + [d for _, d in nodes])

    @classmethod
    def of_flat(cls, beams: list[int], scores: list[int], nb: int) -> "Draft":
        bl, dl = len(beams) // nb, len(scores) // nb
        return cls([beams[i * bl:(i + 1) * bl] for i in range(nb)], [scores[i * dl:(i + 1) * dl] for i in range(nb)])

    @classmethod
    def empty(cls, nb: int, bl: int) -> "Draft":
        """nb rows of zeros: the placeholder of a row without a host tree (never packed: its mask is off)."""
        return cls([[0] * bl for _ in range(nb)], [[0] * (bl - 1) for _ in range(nb)])


class ProposerState:
    """A proposer's own state for one request (`Sequence.proposer_state`), subclassed by the proposer that keeps
    one (ngram.NgramState: the index of the request's N-grams)."""


@dataclass
class Sequence:
    """A request admitted by the engine (`Engine.new_sequence`): its `spec` and the state of its decoding."""

    seq_id: Hashable  # the request's id (Request.request_id), one id from the client to the KV cache
    spec: RequestSpec
    max_len: int  # prompt + output limit (engine max_seq_len)
    output: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)  # of `output`, where the request asked for them
    ctx_len: int = 0  # committed KV entries (mirror of the device's SlotState.ctx_len)
    prefix_len: int = 0  # in its prompt phase: the leading tokens whose K/V it holds (prefix cache, earlier chunks)
    prefill_chunk: int = 0  # in its prompt phase: the most tokens its next prompt step computes (0: all the rest)
    slot: int = -1  # batch slot while admitted (-1: none)
    prefilled: bool = False  # its prompt has been processed (it has a true token and, for ReDrafter, a tree)
    proposer: str = "redrafter"  # what drafts its trees (config.PROPOSERS; the spec's, resolved), when speculative
    tree: Optional[TreeNodes] = None  # its next draft tree as the policy sees it (or its last one, if not fresh)
    tree_fresh: bool = False  # `tree` was drafted after its last step (else a step since made it stale)
    pending: Optional[Draft] = None  # the next tree as the host composed it, packed by the next step
    proposer_state: Optional[ProposerState] = None  # its proposer's own (ngram.NgramState for N-gram requests)
    grammar: Optional[GrammarState] = None  # its guide's matcher and next tree's beams (runtime/grammar.py)
    finished: bool = False
    finish_reason: Optional[str] = None  # "stop" | "length" | "cancelled" | "stopped" (a stop request: early stopping)
    stats: SeqStats = field(default_factory=SeqStats)

    stop_ids: frozenset[int] = field(init=False)  # the spec's, as a set

    def __post_init__(self) -> None:
        self.stop_ids = frozenset(self.spec.stop_ids)

    @property
    def prompt(self) -> list[int]:
        return self.spec.prompt

    @property
    def sampling(self) -> SamplingConfig:
        return self.spec.params

    @property
    def stop_sequences(self) -> tuple[tuple[int, ...], ...]:
        return self.spec.stop_sequences

    @property
    def mode(self) -> DecodingMode:
        return self.spec.mode

    @mode.setter
    def mode(self, mode: DecodingMode) -> None:
        self.spec = dataclasses.replace(self.spec, mode=mode)

    @property
    def speculative(self) -> bool:
        """Decoded with draft trees (mode redrafter, whatever its proposer), not one token per step."""
        return self.mode is DecodingMode.TREE

    @property
    def apple(self) -> bool:
        """A speculative request under the `apple` rule: its whole tree is verified every step (policy.py)."""
        return self.speculative and self.sampling.resolved_acceptance is AcceptanceRule.APPLE

    @property
    def in_prompt_phase(self) -> bool:
        return not self.prefilled

    @property
    def true_token(self) -> int:
        """The last emitted token: the root of the next step's tree (not yet in the KV cache)."""
        return self.output[-1]

    def append(self, tokens: list[int]) -> list[int]:
        """Append emitted tokens, applying stop tokens, the end of its grammar and max_tokens; returns what was
        actually appended."""
        out = []
        for t in tokens:
            if self.finished:
                break
            self.output.append(t)
            out.append(t)
            if self.grammar is not None:
                self.grammar.accept([t])
            ended = self.grammar is not None and self.grammar.terminated  # its grammar's stop token, eos ignored or not
            if ended or t in self.stop_ids or any(len(q) <= len(self.output) and tuple(self.output[-len(q):]) == q
                                                  for q in self.stop_sequences):
                self.finish("stop")
            elif len(self.output) >= self.sampling.max_tokens or len(self.prompt) + len(self.output) >= self.max_len:
                self.finish("length")
        return out

    def finish(self, reason: str) -> None:
        self.finished, self.finish_reason = True, reason
        self.stats.finish_time = time.perf_counter()
