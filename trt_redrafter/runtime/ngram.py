"""Learning-free proposers: drafts from N-grams of the request's own context and of the base model's weights.

The method is the N-Grammys paper's (Stewart, Trager, Gonugondla, Soatto, arXiv 2411.03786): the base model's next
token is rarely the single top guess of a cheap strategy, but often among its top few, so a *batch* of cheap drafts
verified together (here: the beams of one packed tree, verified by the same step as ReDrafter's) buys most of the
speedup of a trained drafter at no training cost. Hugging Face's prompt-lookup decoding is the one-draft case.

    ContextNgrams   one request's index, kept incrementally: for every match length k in [ngram_min, ngram_max], the
                    positions where each k-gram ends. A lookup takes the last k tokens (ending at the true token)
                    and returns what followed their earlier occurrences; no rescan of the context per step.
    ModelNgrams     the base's own bigrams: the top-K next tokens of every vocabulary entry, from one forward pass of
                    the model over that token alone, and its unigrams (the tokens with the highest mean
                    log-probability over all those passes). Computed once at build time (`build_model_ngrams`) into
                    the engine's `ngrams.safetensors`.
    NgramProposer   the batched combination, `nb` drafts of `dl` tokens per request: context matches first (longest
                    k first; within one k by how often the continuation occurred, then by recency), then the
                    model's bigram drafts (the true token's K most likely successors), then unigram starts; each
                    draft shorter than dl is continued by the bigram chain (top-1 successor of its last token).

A context continuation that runs into the end of the context is continued periodically (text that repeated with
period p so far is guessed to go on repeating), which is what a model stuck in a loop does.

Every draft carries a score, as the drafter's beams do, so the one speculation policy (policy.py) verifies what pays
and learns how far to trust them: a context continuation seen c times among the m earlier occurrences of its match
claims c / (m + 1) for its first token, CONTEXT_DECAY less per token after; a model draft claims MODEL_FIRST for its
first token, MODEL_DECAY less per token after. `when` (ProposerConfig.ngram_when) says what is proposed: the model's
drafts only with `always` (on a GPU, where a few more verified tokens cost almost nothing: `auto`), context matches
only otherwise, as Hugging Face's prompt lookup drafts nothing without a match.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save_file

from ..config import ProposerConfig
from ..errors import UserError
from ..log import get_logger
from .proposer import Proposer
from .sequence import Draft, ProposerState, Sequence
from .step import SCORE_FLOOR, quantize_scores

logger = get_logger(__name__)

NGRAMS_FILE = "ngrams.safetensors"
MAX_OCCURRENCES = 8  # most recent occurrences of one k-gram a lookup looks at (bounded cost per step)
TABLE_TOP_K = 8  # successors kept per vocabulary entry (the most beams a bigram draft set can use)
CONTEXT_DECAY = 0.85  # claimed confidence of each further token of a context continuation
MODEL_FIRST, MODEL_DECAY = 0.1, 0.5  # claimed confidence of a model draft's first token, and of each further one


class ContextNgrams:
    """A request's context and, for each k in [kmin, kmax], k-gram -> end positions (in order of occurrence)."""

    __slots__ = ("tokens", "kmin", "kmax", "index")

    def __init__(self, kmin: int, kmax: int):
        self.tokens: list[int] = []
        self.kmin, self.kmax = kmin, kmax
        self.index: dict[int, dict[tuple[int, ...], list[int]]] = {k: {} for k in range(kmin, kmax + 1)}

    def extend(self, tokens: list[int]) -> None:
        toks = self.tokens
        for t in tokens:
            toks.append(t)
            i = len(toks) - 1
            for k, table in self.index.items():
                if i + 1 >= k:
                    table.setdefault(tuple(toks[i + 1 - k:]), []).append(i)

    def sync(self, seq: Sequence) -> None:
        """Index the tokens `seq` has that this index has not seen yet (prompt, then output)."""
        n, np_ = len(self.tokens), len(seq.prompt)
        if n < np_:
            self.extend(seq.prompt[n:])
            n = np_
        if n - np_ < len(seq.output):
            self.extend(seq.output[n - np_:])

    def continuations(self, length: int, limit: int, min_k: int = 0) -> list[tuple[list[int], float]]:
        """Up to `limit` distinct continuations of `length` tokens of the context's last k tokens (k >= min_k),
        longest k first; within one k ranked by count, then recency; each with the share of the k-gram's earlier
        occurrences it followed (count / (occurrences + 1))."""
        toks = self.tokens
        n = len(toks)
        out: list[tuple[list[int], float]] = []
        seen: set[tuple[int, ...]] = set()
        for k in range(min(self.kmax, n - 1), max(self.kmin, min_k) - 1, -1):
            ends = self.index[k].get(tuple(toks[n - k:]))
            if not ends or len(ends) < 2:  # the last k tokens themselves are always one occurrence
                continue
            ranked: dict[tuple[int, ...], list[int]] = {}  # continuation -> [count, recency rank]
            earlier = ends[-1 - MAX_OCCURRENCES:-1]
            for r, i in enumerate(reversed(earlier)):  # most recent first, not position n-1
                period = n - 1 - i  # tokens after this occurrence up to the true token (>= 1)
                cont = tuple(toks[i + 1 + j % period] for j in range(length))
                entry = ranked.get(cont)
                if entry is None:
                    ranked[cont] = [1, r]
                else:
                    entry[0] += 1
            for cont, (count, _) in sorted(ranked.items(), key=lambda kv: (-kv[1][0], kv[1][1])):
                if cont not in seen:
                    seen.add(cont)
                    out.append((list(cont), count / (len(earlier) + 1)))
                    if len(out) == limit:
                        return out
        return out


@dataclass
class NgramState(ProposerState):
    """An N-gram request's own state: the index of its tokens, kept in step with them."""

    index: ContextNgrams


@dataclass
class ModelNgrams:
    """The base model's bigram successors [V, K] and unigrams [K] (token ids), as host lists for O(1) lookups."""

    successors: torch.Tensor  # [V, K] int32
    unigrams: torch.Tensor  # [K] int32

    def __post_init__(self):
        self._succ = self.successors.tolist()
        self._uni = self.unigrams.tolist()
        self._chains: dict[int, list[list[int]]] = {}

    @property
    def vocab_size(self) -> int:
        return self.successors.shape[0]

    def starts(self, token: int) -> tuple[int, ...]:
        """First drafted tokens after `token`, best first: its successors, then the unigrams."""
        return (*self._succ[token], *self._uni)

    def chains(self, length: int) -> list[list[int]]:
        """chain[t] = the `length` tokens the bigram table predicts after t, each the top-1 successor of the last."""
        out = self._chains.get(length)
        if out is None:
            top1 = self.successors[:, 0].long()
            cols, cur = [], torch.arange(self.vocab_size)
            for _ in range(length):
                cur = top1[cur]
                cols.append(cur)
            out = self._chains[length] = torch.stack(cols, 1).tolist() if cols else [[] for _ in range(self.vocab_size)]
        return out

    def save(self, path: str | Path) -> None:
        save_file({"successors": self.successors.contiguous(), "unigrams": self.unigrams.contiguous()}, str(path))

    @classmethod
    def load(cls, path: str | Path, vocab_size: int) -> "ModelNgrams":
        try:
            t = load_file(str(path))
            table = cls(t["successors"].to(torch.int32), t["unigrams"].to(torch.int32))
        except (OSError, KeyError, RuntimeError) as e:
            raise UserError(f"cannot read the model N-gram table {path} ({e}); rebuild the engine.") from e
        if table.vocab_size != vocab_size:
            raise UserError(f"{path} covers {table.vocab_size} tokens but the model has {vocab_size}; rebuild the "
                            f"engine.")
        return table


class NgramProposer(Proposer):
    """Host proposer: `nb` drafts of `dl` tokens per request from its context and the model's N-grams, scored."""

    name = "ngram"
    on_host = True

    def __init__(self, num_beams: int, draft_len: int, cfg: ProposerConfig, table: Optional[ModelNgrams] = None,
                 when: str = "always"):
        super().__init__()
        self.num_beams, self.draft_len = num_beams, draft_len
        self.kmin, self.kmax = cfg.ngram_min, cfg.ngram_max
        self.table = table
        self.when = when  # always: model drafts too; matched: context matches only
        self._chain = table.chains(draft_len) if table is not None else None

    def _index(self, seq: Sequence, min_k: int) -> ContextNgrams:
        state = seq.proposer_state
        if not isinstance(state, NgramState):
            # a request asks with one min_k all its life: shorter k-grams are never indexed
            state = seq.proposer_state = NgramState(ContextNgrams(max(self.kmin, min(min_k, self.kmax)), self.kmax))
        state.index.sync(seq)
        return state.index

    def context_drafts(self, seq: Sequence, limit: int, min_k: int = 0) -> list[list[int]]:
        """Up to `limit` drafts [true token, dl drafted tokens] from context matches (of >= min_k tokens) only."""
        return self.context_draft(seq, limit, min_k, fill=False).rows

    def context_draft(self, seq: Sequence, limit: int, min_k: int = 0, fill: bool = True) -> Optional[Draft]:
        """Context matches only, scored (None without one); `fill`: padded to nb rows (`fill_rows`)."""
        true, dl = seq.true_token, self.draft_len
        found = self._index(seq, min_k).continuations(dl, limit, min_k)
        if not found:
            return None if fill else Draft([], [])
        rows = [[true, *c] for c, _ in found]
        scores = [_chain_scores(share, CONTEXT_DECAY, dl) for _, share in found]
        return Draft(*fill_rows(rows, self.num_beams, true, dl, scores)) if fill else Draft(rows, scores)

    def compose(self, seq: Sequence, device: Optional[Draft] = None) -> Optional[Draft]:
        """Exactly nb drafts: context, then (`when` always) bigram, then unigram; None without any."""
        nb, dl = self.num_beams, self.draft_len
        ctx = self.context_draft(seq, nb, fill=False)
        rows, scores = ctx.rows, ctx.scores
        if self.when == "always" and len(rows) < nb and self.table is not None:
            true, chain = seq.true_token, self._chain
            have = {r[1] for r in rows}  # one model draft per distinct first token
            model = _chain_scores(MODEL_FIRST, MODEL_DECAY, dl)
            for first in self.table.starts(true):
                if len(rows) == nb:
                    break
                if first not in have:
                    have.add(first)
                    rows.append([true, first, *chain[first][:dl - 1]])
                    scores.append(model)
        if not rows:
            return None
        return Draft(*fill_rows(rows, nb, seq.true_token, dl, scores))

    def drafts(self, seq: Sequence) -> Optional[list[list[int]]]:
        """The rows of `compose` (tests and tools that want the token rows alone)."""
        d = self.compose(seq)
        return d.rows if d is not None else None


def _chain_scores(first: float, decay: float, dl: int) -> list[int]:
    """Quantized log-confidence of a draft's prefixes: `first` for its first token, `decay` times less per token."""
    lf, ld = math.log(max(first, 1e-9)), math.log(decay)
    return quantize_scores(torch.tensor([lf + j * ld for j in range(dl)])).tolist()


def fill_rows(rows: list[list[int]], nb: int, true: int, dl: int, scores: Optional[list[list[int]]] = None):
    """Pad a draft set to nb rows by repeating its first row (duplicates add no tree node), or the true token;
    with `scores`, -> (rows, scores) padded alike."""
    if not rows:
        rows = [[true] * (dl + 1)]
        scores = [[SCORE_FLOOR] * dl] if scores is not None else None
    rows = rows + [rows[0]] * (nb - len(rows))
    if scores is None:
        return rows
    return rows, scores + [scores[0]] * (nb - len(scores))


# ---- building the model's table ------------------------------------------------------------------------------

@torch.inference_mode()
def build_model_ngrams(model, vocab_size: int, top_k: int = TABLE_TOP_K, chunk: int = 512,
                       progress: bool = True) -> ModelNgrams:
    """Run `model` (a one-rank `LlamaRank`) over every vocabulary entry alone (position 0, no context) -> the top-K
    successors of each token and the K tokens with the highest mean log-probability (unigrams).

    Each chunk of C tokens is one batch row of C independent one-token sequences: a tree whose mask is the identity,
    so every token attends to itself only, through the same attention code as decoding.
    """
    from tqdm import tqdm

    from ..model.attention import AttentionMeta

    t0 = time.perf_counter()
    dev = model.embedding.device
    shape = (chunk, model.nkv, model.D)  # one block of `chunk` KV slots per layer: each token reads only its own
    k_caches = [torch.zeros(shape, dtype=model.dtype, device=dev) for _ in model.layers]
    v_caches = [torch.zeros(shape, dtype=model.dtype, device=dev) for _ in model.layers]
    succ = torch.empty(vocab_size, top_k, dtype=torch.int32)
    logp_sum = torch.zeros(vocab_size, dtype=torch.float64)
    starts = range(0, vocab_size, chunk)
    for s in tqdm(starts, desc="model n-grams", unit="chunk", disable=not progress or None):
        ids = torch.arange(s, min(s + chunk, vocab_size), device=dev)
        C = ids.shape[0]
        ar = torch.arange(C, device=dev)
        meta = AttentionMeta(positions=torch.zeros(1, C, dtype=torch.long, device=dev), write_slots=ar[None],
                             block_table=torch.zeros(1, 1, dtype=torch.long, device=dev),
                             ctx_len=torch.zeros(1, dtype=torch.long, device=dev),
                             tree_mask=torch.eye(C, dtype=torch.bool, device=dev)[None], block_size=C)
        hidden = model(ids[None], meta, (k_caches, v_caches))  # [1, C, H]
        logits = model.logits(hidden[0]).float()[:, :vocab_size]  # [C, V]
        succ[s:s + C] = logits.topk(top_k, dim=-1).indices.to(torch.int32).cpu()
        logp_sum += torch.log_softmax(logits, dim=-1).sum(0).double().cpu()
    unigrams = logp_sum.topk(top_k).indices.to(torch.int32)
    logger.info("model n-gram table: %d tokens x top-%d in %.1fs", vocab_size, top_k, time.perf_counter() - t0)
    return ModelNgrams(succ, unigrams)

