"""One request's output as the engine streams it: token ids in, OpenAI text out.

Per engine response (one decode step's accepted tokens, `Step`), `Generation.on_step` detokenizes token by token
(`IncrementalDecoder`), cuts the text at the first stop string (`StopMatcher`) and keeps the ReDrafter statistics
(`ReDrafterStats`). Token by token, so `completion_tokens` counts the tokens up to the one that completed a stop
string, not the rest of its step. `finish_reason`: "stop" for a stop string or the end token, else "length"
(max_tokens, or the engine's max_seq_len).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ...decoding.logprobs import TokenLogprob
from ..text import IncrementalDecoder, TextCodec
from .protocol import LoggedToken


@dataclass
class Step:
    """One engine response: the tokens it adds and the request's statistics so far (None where not sent)."""

    ids: list[int]
    final: bool = False
    accepted_draft_tokens: Optional[int] = None
    draft_tokens: Optional[int] = None
    acceptance_rate: Optional[float] = None
    reused_blocks: Optional[int] = None  # kv_cache_reused_blocks: the prompt's KV blocks taken from the prefix cache
    logprobs: Optional[list[TokenLogprob]] = None  # of ids (output_log_probs, top_token_ids, top_log_probs)


class StopMatcher:
    """Cuts text at the first occurrence of any stop string. Text that may be the start of a stop string is held
    back until the next piece shows whether it is (so a stream never shows part of a stop string)."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.pending = ""  # held back: a suffix that is a proper prefix of some stop string
        self.hit = False

    def push(self, text: str) -> str:
        """The part of `text` (after what was held back) that is certainly output."""
        if not self.stops or self.hit:
            return "" if self.hit else text
        buf = self.pending + text
        found = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if found:
            self.hit, self.pending = True, ""
            return buf[:min(found)]
        keep = max((k for s in self.stops for k in range(1, min(len(s) - 1, len(buf)) + 1) if buf.endswith(s[:k])),
                   default=0)
        self.pending = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        """At the end of the output: what was held back is output after all."""
        out, self.pending = self.pending, ""
        return out


@dataclass
class ReDrafterStats:
    """What the engine reports about a request's speculation, as in its final response (TensorRT-LLM's names:
    total_accepted_draft_tokens, total_draft_tokens, acceptance_rate), plus what the responses themselves show: the
    first response holds the prompt step's token, each later one a generation step's accepted tokens + 1."""

    accepted_draft_tokens: int = 0
    draft_tokens: int = 0
    acceptance_rate: float = 0.0
    responses: int = 0  # engine responses with tokens
    tokens_in_steps: int = 0  # tokens of the generation steps (after the prompt step)
    reused_blocks: Optional[int] = None  # the prompt's KV blocks the engine took from its prefix cache

    def add(self, step: Step) -> None:
        if step.ids:
            if self.responses:
                self.tokens_in_steps += len(step.ids)
            self.responses += 1
        if step.accepted_draft_tokens is not None:
            self.accepted_draft_tokens = step.accepted_draft_tokens
        if step.draft_tokens is not None:
            self.draft_tokens = step.draft_tokens
        if step.acceptance_rate is not None:
            self.acceptance_rate = step.acceptance_rate
        if step.reused_blocks is not None:
            self.reused_blocks = step.reused_blocks

    def as_dict(self) -> dict:
        steps = max(self.responses - 1, 0)
        return {"accepted_draft_tokens": self.accepted_draft_tokens, "draft_tokens": self.draft_tokens,
                "acceptance_rate": round(self.acceptance_rate, 6), "generation_steps": steps,
                "tokens_per_step": round(self.tokens_in_steps / steps, 6) if steps else 0.0}


@dataclass
class Generation:
    codec: TextCodec
    stops: tuple[str, ...] = ()
    end_id: int = -1  # the token that ends the output ("stop"); -1: none
    completion_tokens: int = 0
    text: str = ""
    finish_reason: Optional[str] = None
    stats: ReDrafterStats = field(default_factory=ReDrafterStats)

    logged: list[LoggedToken] = field(default_factory=list)  # the counted tokens' log-probabilities (when asked)

    def __post_init__(self):
        self._decoder = IncrementalDecoder(self.codec)
        self._matcher = StopMatcher(self.stops)
        self._last: Optional[int] = None
        self._taken = 0  # logged[:_taken] went out in earlier chunks
        self._offset = 0  # their text's length (completions' text_offset)

    def take_logged(self) -> tuple[list[LoggedToken], int]:
        """The tokens logged since the last call, and the text offset of the first of them."""
        new, start = self.logged[self._taken:], self._offset
        self._taken = len(self.logged)
        self._offset += sum(len(t.text) for t in new)
        return new, start

    def _log(self, token: int, lp: TokenLogprob) -> None:
        c = self.codec
        self.logged.append(LoggedToken(c.token_text(token), c.token_bytes(token), lp.logprob,
                                       [(c.token_text(i), c.token_bytes(i), x) for i, x in lp.top]))

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def on_step(self, step: Step) -> str:
        """The text this engine response adds; at a stop string (or the final response) the output is done."""
        assert not self.done, "a finished generation got another step"
        self.stats.add(step)
        out = []
        for i, token in enumerate(step.ids):
            self.completion_tokens += 1
            self._last = token
            if step.logprobs is not None:
                self._log(token, step.logprobs[i])
            out.append(self._matcher.push(self._decoder.push(token)))
            if self._matcher.hit:
                self.finish_reason = "stop"
                break
        piece = "".join(out)
        if step.final and not self.done:
            piece += self._end()
        self.text += piece
        return piece

    def finish(self) -> str:
        """The engine's output ended without a final response saying so: end it here (the text this adds)."""
        piece = self._end()
        self.text += piece
        return piece

    def _end(self) -> str:
        """Flush what was held back and set finish_reason; returns the text that adds."""
        piece = self._matcher.push(self._decoder.flush())
        if self._matcher.hit:
            self.finish_reason = "stop"
            return piece
        piece += self._matcher.flush()
        self.finish_reason = "stop" if self._last is not None and self._last == self.end_id else "length"
        return piece
