"""Structured output: a request's grammar (config.Guide: JSON, a JSON schema, a regex, an EBNF grammar, a structural
tag) turned into token bitmasks for the steps that choose its tokens, with xgrammar as the backend.

The reference is constrained AR decoding: at every position the grammar's mask is applied to the base model's logits
before the token is chosen. A tree step keeps that exactly: every verified node gets the mask of its own path (the
grammar's state after the request's output and the node's ancestors), the step chooses the target's token at each
node from masked logits, and acceptance then takes the longest drafted path that matches (decoding/acceptance.py).
A drafted token the grammar forbids at its parent can never match, so whatever lies below it is never accepted; its
mask is left all-allowing. Greedy constrained ReDrafter is therefore greedy constrained AR token for token, and
sampled is sampled AR for the same seed (the draws are the same draws, over the same masked distribution).

    Grammars      per engine: xgrammar's tokenizer info (built once, from the engine's tokenizer/) and compiler,
                  which caches compiled grammars by their source
    GrammarState  per request: its matcher, advanced by every token the request emits, and the beams of the tree it
                  verifies next (the host's copy: the step returns a grammar request's beams with its row)

Masks are filled on the host before a step, from what the host already holds, and enter the step as one static-shape
int32 tensor per step kind (AR [bs, words], tree [bs, nb, bl, words]): no host sync is added, and no grammar
recompiles the step.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from ..config import Guide, GuideType
from ..decoding import bitmask
from ..errors import UserError


ANY_OBJECT = '{"type": "object"}'  # a `json` guide: any JSON object (OpenAI's json_object)


class Grammars:
    """An engine's grammar backend (built on first use: an engine that never sees a guided request never loads it),
    and its host work for a batch's steps: the token bitmasks and the trees repaired to follow each grammar (their
    time adds up in `seconds`)."""

    def __init__(self, tokenizer_dir: Optional[Path], vocab_size: int, tree_shape: tuple[int, int] = (1, 1)):
        """`tree_shape`: (beams, beam length) of the engine's draft trees."""
        self.tokenizer_dir, self.vocab_size, self.tree_shape = tokenizer_dir, vocab_size, tree_shape
        self.words = bitmask.words(vocab_size)
        self.seconds = 0.0
        self._compiler = None
        self._lock = threading.Lock()  # requests are submitted (and their grammars compiled) from serving threads

    def _backend(self):
        with self._lock:
            if self._compiler is None:
                self._compiler = self._load()
        return self._compiler

    def _load(self):
        """xgrammar's tokenizer info (each token's text, from the engine's tokenizer/) and a compiler over it."""
        try:
            import xgrammar
        except ImportError as e:  # a dependency; only a broken install lacks it
            raise UserError(f"guided decoding needs xgrammar, which does not import here ({e}); "
                            f"pip install 'xgrammar>=0.2,<0.3'.") from e
        from transformers import AutoTokenizer

        d = self.tokenizer_dir
        if d is None or not d.is_dir():
            raise UserError(f"guided decoding needs the engine's tokenizer (each token's text), and "
                            f"{d or 'this engine'} has none; rebuild the engine with build-engine --tokenizer DIR.")
        info = xgrammar.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(str(d)),
                                                       vocab_size=self.vocab_size)
        return xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=True)

    def compile(self, guide: Guide):
        """The compiled grammar of `guide` (cached by its source); one sentence for a source xgrammar refuses. JSON
        is compact, as json.dumps writes it (", " and ": ", no other whitespace): a model cannot loop in whitespace,
        and more of each document is forced."""
        c = self._backend()
        try:
            if guide.kind in (GuideType.JSON, GuideType.JSON_SCHEMA):
                source = _schema_text(guide.source) if guide.kind is GuideType.JSON_SCHEMA else ANY_OBJECT
                return c.compile_json_schema(source, any_whitespace=False)
            if guide.kind is GuideType.REGEX:
                return c.compile_regex(guide.source)
            if guide.kind is GuideType.EBNF:
                return c.compile_grammar(guide.source)
            return _compile_structural_tag(c, guide.source)
        except UserError:
            raise
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's parse errors: first line, without its prefix
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"invalid {guide.kind} guide: {reason.split('] ', 1)[-1]}") from None

    def masks(self, seqs: list, keep: Optional[list[int]] = None) -> torch.Tensor:
        """The token bitmasks of a step over `seqs` (sequence.Sequence, each with its GrammarState or None): per
        request, its next token's ([len, words]: a prompt or AR step, keep None) or its tree's nodes' in beam layout
        ([len, nb, bl, words]: a tree step; the root's alone where it keeps the root alone). Requests without a
        grammar allow every token."""
        t0 = time.perf_counter()
        nb, bl = self.tree_shape
        out = bitmask.full(len(seqs), *((nb, bl) if keep is not None else ()), self.words)
        for i, s in enumerate(seqs):
            if s.grammar is not None:
                out[i] = s.grammar.next_mask() if keep is None else s.grammar.tree_masks(nb, bl, keep[i] > 1)
        self.seconds += time.perf_counter() - t0
        return out

    def follow(self, seqs: list, floor: int) -> list[tuple[object, list[list[int]], list[list[int]]]]:
        """Grammar-aware drafting for speculative requests after a step: a fresh tree (its beams and scores, held by
        the grammar state) repaired to follow the grammar (`GrammarState.repair`); without one (the step drafted
        none: an AR step, a probe's rest), a tree of the tokens the grammar forces next, where it forces any
        (`GrammarState.forced_tree`) -> (request, rows, scores) of each new or changed tree."""
        t0 = time.perf_counter()
        out = []
        nb, bl = self.tree_shape
        for s in seqs:
            g = s.grammar
            if not s.tree_fresh:
                tree = g.forced_tree(s.true_token, nb, bl, floor)
            elif g.beams is not None and g.scores is not None:
                tree = g.repair(g.beams, g.scores, floor)
                tree = tree if tree != (g.beams, g.scores) else None
            else:
                tree = None
            if tree is not None:
                g.hold(*tree)
                out.append((s, *tree))
        self.seconds += time.perf_counter() - t0
        return out

    def start(self, guide: Guide, stop_ids: Sequence[int]) -> "GrammarState":
        """A new request's grammar state. The grammar ends with one of `stop_ids` (default: the tokenizer's EOS)."""
        import xgrammar

        matcher = xgrammar.GrammarMatcher(self.compile(guide), override_stop_tokens=list(stop_ids) or None)
        return GrammarState(matcher, self.vocab_size)


def _schema_text(source: str) -> str:
    """A JSON schema as text, checked as JSON and against the JSON Schema meta-schema first, so a bad one is refused
    with the reason (xgrammar ignores what it does not know)."""
    try:
        schema = json.loads(source)
    except json.JSONDecodeError as e:
        raise UserError(f"invalid json_schema guide: not JSON ({e}).") from None
    if not isinstance(schema, (dict, bool)):
        raise UserError(f"invalid json_schema guide: a schema is a JSON object, got {type(schema).__name__}.")
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise UserError(f"invalid json_schema guide: {e.message} (at {'/'.join(map(str, e.path)) or 'the root'}).") \
            from None
    return source


def _compile_structural_tag(compiler, source: str):
    """TensorRT-LLM's structural tag ({"structures": [{"begin", "schema", "end"}], "triggers": [...]}) or xgrammar's
    own format (any other JSON)."""
    import xgrammar

    try:
        tag = json.loads(source)
    except json.JSONDecodeError as e:
        raise UserError(f"invalid structural_tag guide: not JSON ({e}).") from None
    if isinstance(tag, dict) and "structures" in tag and "triggers" in tag:
        items = [xgrammar.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                 for s in tag["structures"]]
        return compiler.compile_structural_tag(items, tag["triggers"])
    return compiler.compile_structural_tag(source)


class GrammarState:
    """One request's grammar: its matcher (advanced by every token it emits) and the beams of its next tree."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size
        self.words = bitmask.words(vocab_size)
        self.beams: Optional[list[list[int]]] = None  # rows [nb][bl] of the tree the next tree step verifies
        self.scores: Optional[list[list[int]]] = None  # and their scores [nb][dl], where the host has them

    def hold(self, rows: list[list[int]], scores: list[list[int]]) -> None:
        """The beams (and their scores) of the tree the request's next tree step verifies."""
        self.beams, self.scores = rows, scores

    @property
    def terminated(self) -> bool:
        """The grammar has ended (it accepted one of its stop tokens): nothing may follow."""
        return self.matcher.is_terminated()

    def accept(self, tokens: Sequence[int]) -> None:
        """The request emitted `tokens` (chosen under this grammar's masks, so each is allowed)."""
        for t in tokens:
            if not self.matcher.accept_token(int(t)):
                raise RuntimeError(f"token {t} was emitted under a grammar that does not allow it")

    def repair(self, rows: list[list[int]], scores: list[list[int]], floor: int
               ) -> tuple[list[list[int]], list[list[int]]]:
        """A drafted tree made to follow the grammar (grammar-aware drafting), beams rows [nb][bl] (column 0 the
        request's true token, already emitted) with their prefix scores [nb][dl]:
            - a beam keeps its drafted tokens up to the first the grammar forbids (which could never be accepted);
              from there it takes the tokens the grammar forces (xgrammar's jump-forward: the only continuation of
              the text), each as sure as its parent; what is left of it scores `floor`;
            - where the grammar forces tokens right after the root and no beam starts with them, they take the
              place of the lowest-ranked beam, certain (score 0).
        The tree stays a set of candidates: the step verifies them against the masked target, so output is
        unchanged, and only acceptance grows."""
        nb, bl = len(rows), len(rows[0])
        out_rows, out_scores = [], []
        for row, sc in zip(rows, scores):
            new, new_sc, parent, taken = [row[0]], [], 0, 0
            for t, score in zip(row[1:], sc):
                if not self._take(t):
                    break
                taken += 1
                new.append(t)
                new_sc.append(score)
                parent = score
            if len(new) < bl:
                forced = self.matcher.find_jump_forward_tokens()[:bl - len(new)]
                new += forced
                new_sc += [parent] * len(forced)
            self.matcher.rollback(taken)
            out_rows.append(new + row[len(new):])
            out_scores.append(new_sc + [floor] * (bl - len(new)))
        forced = self.matcher.find_jump_forward_tokens()[:bl - 1]
        if forced and not any(r[1:1 + len(forced)] == forced for r in out_rows):
            worst = min(range(nb), key=lambda b: out_scores[b][0])
            out_rows[worst] = [rows[0][0]] + forced + rows[worst][1 + len(forced):]
            out_scores[worst] = [0] * len(forced) + [floor] * (bl - 1 - len(forced))
        return out_rows, out_scores

    def forced_tree(self, root: int, nb: int, bl: int, floor: int
                    ) -> Optional[tuple[list[list[int]], list[list[int]]]]:
        """A tree of one beam (the others copies: one path) holding the tokens the grammar forces after `root` (the
        request's last token, already accepted), certain; None where it forces none."""
        forced = self.matcher.find_jump_forward_tokens()[:bl - 1]
        if not forced:
            return None
        pad = bl - 1 - len(forced)
        row, scores = [root] + forced + [0] * pad, [0] * len(forced) + [floor] * pad
        return [list(row) for _ in range(nb)], [list(scores) for _ in range(nb)]

    def _take(self, t: int) -> bool:
        """Advance the matcher by drafted token t where the grammar allows it and does not end there."""
        if not 0 <= t < self.vocab_size or not self.matcher.accept_token(int(t)):
            return False
        if self.matcher.is_terminated():  # a stop token: nothing follows it
            self.matcher.rollback(1)
            return False
        return True

    def next_mask(self) -> torch.Tensor:
        """[words] int32: the tokens allowed next (an AR step's, a prompt step's)."""
        out = bitmask.full(1, self.words)
        self.matcher.fill_next_token_bitmask(out, 0)
        return out[0]

    def tree_masks(self, num_beams: int, beam_length: int, fresh: bool) -> torch.Tensor:
        """[nb, bl, words] int32: at beam position (b, j), the tokens allowed after the output and beams[b][1..j] (the
        mask of the tree node there). Only the root's where the stored tree is not fresh (an AR step came after it
        was drafted: the step keeps the root alone)."""
        out = bitmask.full(num_beams * beam_length, self.words)
        beams = self.beams if fresh and self.beams is not None else None
        root = self.next_mask()
        if beams is None:
            out.view(num_beams, beam_length, -1)[:, 0] = root
            return out.view(num_beams, beam_length, -1)
        rows: dict[tuple[int, ...], torch.Tensor] = {(): root}
        self._walk(beams, (), rows)
        for b, beam in enumerate(beams):
            for j in range(beam_length):
                mask = rows.get(tuple(beam[1:j + 1]))
                if mask is not None:  # else a drafted token on its path is forbidden: never accepted
                    out[b * beam_length + j] = mask
        return out.view(num_beams, beam_length, -1)

    def _walk(self, beams: list[list[int]], prefix: tuple[int, ...], rows: dict) -> None:
        """Fill rows[prefix + (t,)] for every drafted child t of `prefix` the grammar allows, depth first (the matcher
        stands at `prefix`; it is rolled back after each child)."""
        depth = len(prefix)
        children = dict.fromkeys(b[depth + 1] for b in beams if len(b) > depth + 1 and tuple(b[1:depth + 1]) == prefix)
        for t in children:
            if not self._take(t):  # forbidden (never accepted) or a stop token (the request ends there)
                continue
            child = prefix + (t,)
            rows[child] = self.next_mask()
            self._walk(beams, child, rows)
            self.matcher.rollback(1)
