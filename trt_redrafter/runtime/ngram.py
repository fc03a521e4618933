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

Where verifying a tree costs noticeably more than an AR step (a CPU: each verified token is a share of a step),
drafting only pays when enough is accepted. `when` says when a request verifies a tree: `always` (model drafts
without a context match), `matched` (only on a context match; otherwise the caller takes an AR step, as Hugging
Face's prompt lookup drafts nothing without a match), `adaptive` (on a match, and only while the request's own
accepted tokens per verified tree, a running mean, cover the measured cost of a tree step over an AR step; re-trying
every `PROBE_EVERY` skipped matches, so that a context that starts repeating is noticed).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save_file

from ..config import ProposerConfig
from ..errors import UserError
from ..log import get_logger
from .sequence import Sequence

logger = get_logger(__name__)

NGRAMS_FILE = "ngrams.safetensors"
MAX_OCCURRENCES = 8  # most recent occurrences of one k-gram a lookup looks at (bounded cost per step)
TABLE_TOP_K = 8  # successors kept per vocabulary entry (the most beams a bigram draft set can use)
GAIN_DECAY = 0.7  # running mean of accepted tokens per verified tree: weight of the past
PROBE_EVERY = 8  # a request that stopped drafting drafts again after this many skipped context matches


class ContextNgrams:
    """A request's context and, for each k in [kmin, kmax], k-gram -> end positions (in order of occurrence); and
    how its drafts fared (`gain`: running mean of accepted tokens per verified tree; `skips`: matches not drafted)."""

    __slots__ = ("tokens", "kmin", "kmax", "index", "gain", "skips")

    def __init__(self, kmin: int, kmax: int):
        self.tokens: list[int] = []
        self.kmin, self.kmax = kmin, kmax
        self.index: dict[int, dict[tuple[int, ...], list[int]]] = {k: {} for k in range(kmin, kmax + 1)}
        self.gain, self.skips = 1.0, 0  # optimistic until measured

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

    def continuations(self, length: int, limit: int, min_k: int = 0) -> list[list[int]]:
        """Up to `limit` distinct continuations of `length` tokens of the context's last k tokens (k >= min_k),
        longest k first; within one k ranked by count, then recency."""
        toks = self.tokens
        n = len(toks)
        out: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        for k in range(min(self.kmax, n - 1), max(self.kmin, min_k) - 1, -1):
            ends = self.index[k].get(tuple(toks[n - k:]))
            if not ends or len(ends) < 2:  # the last k tokens themselves are always one occurrence
                continue
            ranked: dict[tuple[int, ...], list[int]] = {}  # continuation -> [count, recency rank]
            for r, i in enumerate(reversed(ends[-1 - MAX_OCCURRENCES:-1])):  # most recent first, not position n-1
                period = n - 1 - i  # tokens after this occurrence up to the true token (>= 1)
                cont = tuple(toks[i + 1 + j % period] for j in range(length))
                entry = ranked.get(cont)
                if entry is None:
                    ranked[cont] = [1, r]
                else:
                    entry[0] += 1
            for cont, _ in sorted(ranked.items(), key=lambda kv: (-kv[1][0], kv[1][1])):
                if cont not in seen:
                    seen.add(cont)
                    out.append(list(cont))
                    if len(out) == limit:
                        return out
        return out


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


class NgramProposer:
    """Host proposer: `nb` drafts of `dl` tokens per request from its context and the model's N-grams."""

    def __init__(self, num_beams: int, draft_len: int, cfg: ProposerConfig, table: Optional[ModelNgrams] = None):
        self.num_beams, self.draft_len = num_beams, draft_len
        self.kmin, self.kmax = cfg.ngram_min, cfg.ngram_max
        self.table = table
        self._chain = table.chains(draft_len) if table is not None else None

    def _index(self, seq: Sequence, min_k: int) -> ContextNgrams:
        idx = seq.context_index
        if idx is None:  # a request asks with one min_k all its life: shorter k-grams are never indexed
            idx = seq.context_index = ContextNgrams(max(self.kmin, min(min_k, self.kmax)), self.kmax)
        idx.sync(seq)
        return idx

    def context_drafts(self, seq: Sequence, limit: int, min_k: int = 0) -> list[list[int]]:
        """Up to `limit` drafts [true token, dl drafted tokens] from context matches (of >= min_k tokens) only."""
        true = seq.true_token
        return [[true, *c] for c in self._index(seq, min_k).continuations(self.draft_len, limit, min_k)]

    def drafts(self, seq: Sequence, when: str = "always", cost_ratio: float = 1.0) -> Optional[list[list[int]]]:
        """Exactly nb drafts (rows of bl tokens, column 0 the true token): context, then bigram, then unigram; or
        None: nothing worth verifying this step (see the module docstring for `when`; `cost_ratio` is the measured
        cost of a tree step over an AR step), the caller steps AR."""
        nb, dl = self.num_beams, self.draft_len
        rows = self.context_drafts(seq, nb)
        if when != "always":
            idx = seq.context_index
            if not rows:
                return None
            if when == "adaptive" and 1.0 + idx.gain < cost_ratio and idx.skips < PROBE_EVERY:
                idx.skips += 1
                return None
            idx.skips = 0
        if len(rows) < nb and self.table is not None:
            true, chain = seq.true_token, self._chain
            have = {r[1] for r in rows}  # one model draft per distinct first token
            for first in self.table.starts(true):
                if len(rows) == nb:
                    break
                if first not in have:
                    have.add(first)
                    rows.append([true, first, *chain[first][:dl - 1]])
        return fill_rows(rows, nb, seq.true_token, dl)

    @staticmethod
    def observe(seq: Sequence, accepted: int) -> None:
        """Record how many drafted tokens the last verified tree of `seq` gave."""
        idx = seq.context_index
        if idx is not None:
            idx.gain = GAIN_DECAY * idx.gain + (1.0 - GAIN_DECAY) * accepted

    def propose(self, seqs: list[Sequence]) -> torch.Tensor:
        """The HostProposer contract (always nb drafts per request)."""
        return torch.tensor([self.drafts(s) for s in seqs], dtype=torch.long)


def fill_rows(rows: list[list[int]], nb: int, true: int, dl: int) -> list[list[int]]:
    """Pad a draft set to nb rows by repeating its first row (duplicates add no tree node), or the true token."""
    if not rows:
        rows = [[true] * (dl + 1)]
    return rows + [rows[0]] * (nb - len(rows))


def packed_length(rows: list[list[int]]) -> int:
    """Packed tree length of a draft set (`decoding.tree.pack_beams` lengths): the root + every distinct prefix."""
    return 1 + len({tuple(r[1:j + 1]) for r in rows for j in range(1, len(r))})


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

