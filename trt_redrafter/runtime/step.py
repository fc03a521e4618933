"""The decode step over a whole batch, as the paper lists it: verify -> accept -> rewind -> draft -> pack.

Every phase is a function of device tensors with static shapes ([bs] slots from a batch bucket, trees padded to
P = max_tree_tokens), no Python loop over requests or tree levels and no host sync, so one `graphs.Unit` can compile
or capture the whole step (`redrafter_step`, `ar_step`) or, for a phase profile, each phase on its own. State
between steps is `SlotState` (rows gathered and scattered by slot) and the paged KV cache.

    verify  the base model over the first T nodes of each request's packed tree (tree attention over the paged
            cache) -> hidden, logits
    accept  the target's token after every tree node (argmax; or one counter-based draw per node for sampling),
            then the longest drafted prefix that matches it among the request's first `keep` nodes (`accept_tokens`;
            `accept_apple` for that rule)
    rewind  move the accepted path's K/V entries to the next committed positions; advance ctx_len, true token
    draft   the proposer's beams and their scores from the hidden state at the last accepted position and the next
            token
    pack    dedup the beams into the next packed tree (`pack_beams`, padded to P), number its nodes best score first
            (`tree.order_by_score`) and store it in the slot rows
An AR step is the same with a one-token tree and no draft/pack. The prompt step (`prefill`) is eager: its
length varies per request, and it runs once per request.

Trees are numbered best node first, so the first k nodes of a tree are its k most confident ones and themselves a
tree: the speculation policy (policy.py) prunes a tree by choosing how many nodes a step verifies (T, a few static
buckets, for the batch) and how many of them count for each request (`keep`, <= T: a request with nothing worth
verifying keeps only its root, an AR step inside the tree step). Pruning removes candidates only, so the tokens
emitted never change. The root verified is always the slot's true token, so a request whose stored tree is older
than its last step (an AR step in between) can still take a tree step with `keep` 1.

With TP > 1, rank 0's acceptance and beams are broadcast (they are equal anyway: every rank sees the same
all-gathered logits), so ranks can never drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..config import AcceptanceRule
from ..decoding import acceptance, beam_search, bitmask, sampling, tree
from ..decoding.logprobs import encode as logprob_columns
from ..decoding.acceptance import Acceptance
from ..decoding.beam_search import BeamSearchResult
from ..model.attention import AttentionMeta
from ..model.llama import LlamaRank
from ..model.tp import Dist
from .kv_cache import PagedKVCache
from .drafter import DeviceDrafter
from .sequence import Draft, TreeNodes
from .state import SlotState, put_rows



@dataclass
class Verified:
    hidden: torch.Tensor  # [bs, P, H] final-norm hidden states of the tree tokens
    logits: torch.Tensor  # [bs, P, V] model dtype


@dataclass
class Accepted:
    decision: torch.Tensor  # [3, bs] long: Acceptance.pack()
    emitted: torch.Tensor  # [bs, bl + 1] long: emitted tokens (bl columns) and their count (last column)


PHASES = ("verify", "accept", "rewind", "draft", "pack")  # in order; a profiled step times each
SCORE_SCALE = 1024  # node scores (log-probabilities) travel as integers: round(score * SCORE_SCALE)
SCORE_FLOOR = -64 * SCORE_SCALE  # and no lower (e^-64: nothing), so LOG_ZERO beams stay comparable
SCORE_PAD = SCORE_FLOOR - 1  # the score of a padding node: below every real one


def quantize_scores(scores: torch.Tensor) -> torch.Tensor:
    """Log-probabilities -> int64 in [SCORE_FLOOR, 0]: what TP ranks broadcast, sort by and the host reads back, so
    every rank orders a tree the same way."""
    return (scores * SCORE_SCALE).round().clamp(SCORE_FLOOR, 0).long()


@dataclass(frozen=True)
class RowLayout:
    """What a decode step returns to the host: one int64 row per request, read back in the step's one host sync.

        tokens [bl]      emitted tokens (the first `count` are valid)
        count            how many tokens the step emitted (accepted drafts + 1)
        tree_len         packed length of the request's next tree (0: the device drafted none this step)
        path [bl]        tree indices of the verified tree's accepted path, root first (0 past the accepted ones)
        scores [P]       quantized scores of the next tree's nodes, best first (when the device drafted)
        positions [P]    and each node's first beam position i * bl + j: the lowest beam i through it, its depth j
        beams [nb * bl]  the device's beams of the next tree, flat, and their scores [nb * dl] (return_beams: the host
                         composes mixed trees from them)
        logprobs         (steps with log-probabilities) per emitted token, `decoding.logprobs.columns(K)`
                         columns, bl tokens' worth for a tree step, one for an AR step
    An AR step returns [next token | 1 | 0].
    """

    bl: int
    P: int
    draft: bool = True
    beams: int = 0  # nb * bl when the beams come back too

    @property
    def width(self) -> int:
        return 2 * self.bl + 2 + (2 * self.P if self.draft else 0) + (2 * self.beams - self.beams // self.bl
                                                                      if self.beams else 0)

    def parse(self, row: list[int]) -> "StepRow":
        bl = self.bl
        count = row[bl]
        at = 2 * bl + 2
        tree_len = row[bl + 1]
        nodes = TreeNodes.of_positions(row[at:at + tree_len], row[at + self.P:at + self.P + tree_len], bl) \
            if self.draft and tree_len else None
        at += 2 * self.P if self.draft else 0
        nbeam = self.beams
        draft = Draft.of_flat(row[at:at + nbeam], row[at + nbeam:], nbeam // bl) if nbeam else None
        return StepRow(tokens=row[:count], tree_len=tree_len, path=row[bl + 2:bl + 2 + count], nodes=nodes,
                       draft=draft)


@dataclass
class StepRow:
    tokens: list[int]
    tree_len: int
    path: list[int]  # tree indices of the accepted path: root, then one per accepted draft
    nodes: Optional[TreeNodes]  # the next tree, node by node (None: the device drafted none)
    draft: Optional[Draft] = None  # the device's beams of the next tree (when the layout returns them)


for _cls in (Verified, Accepted):
    torch.utils._pytree.register_dataclass(_cls)


def move_kv(caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """KV rewind in every layer cache: cache[dst] = cache[src] (src, dst [bs, bl] slots), every source read before
    any destination is written (the oracle of `plugins.KVMover`)."""
    src, dst = src.reshape(-1), dst.reshape(-1)
    for layer_cache in caches:
        layer_cache.index_put_((dst,), layer_cache[src])


@dataclass
class StepKernels:
    """The step's swappable pieces: the PyTorch oracles by default, `plugins` kernels on CUDA (same contracts)."""

    accept_tokens: Callable = acceptance.accept_tokens
    pack_beams: Callable = tree.pack_beams
    draw: Callable = sampling.draw
    move_kv: Callable = move_kv  # (caches, src [bs, bl], dst [bs, bl])

    @classmethod
    def triton(cls, caches: list[torch.Tensor], with_mover: bool = True) -> "StepKernels":
        """The plugins' kernels. `with_mover=False` keeps the PyTorch rewind: under inductor it fuses anyway, and
        the mover writes caches through offsets from the first one, which inductor's mutation analysis cannot see."""
        from .. import plugins

        kernels = cls(accept_tokens=plugins.accept_tokens, pack_beams=plugins.pack_beams, draw=plugins.draw)
        if with_mover:
            mover = plugins.KVMover(caches)
            kernels.move_kv = lambda _caches, src, dst: mover(src, dst)
        return kernels


def node_rows(beam_rows: torch.Tensor, unpacker: torch.Tensor, T: int) -> torch.Tensor:
    """Per-beam-position rows [bs, nb, bl, ...] -> per tree node [bs, T, ...] for the first T nodes (the row of any
    beam position the unpacker maps to the node: positions through one node carry the same row)."""
    bs = unpacker.shape[0]
    flat = unpacker.flatten(1)  # [bs, nb * bl]
    dst = torch.where(flat < T, flat, T)  # positions of nodes past T go to a dropped column
    src = torch.arange(flat.shape[1], device=flat.device).expand(bs, -1)
    first = torch.zeros(bs, T + 1, dtype=torch.long, device=flat.device).scatter(1, dst, src)[:, :T]
    rows = beam_rows.flatten(1, 2)  # [bs, nb * bl, ...]
    return rows.gather(1, first.view(bs, T, *[1] * (rows.dim() - 2)).expand(bs, T, *rows.shape[2:]))


def _call(name: str, phase: Callable, *args):
    return phase(*args)


class DecodeStep:
    """The batched step of one engine; holds references to its model, proposer, KV cache and slot state."""

    def __init__(self, model: LlamaRank, proposer: Optional[DeviceDrafter], cache: PagedKVCache,
                 state: SlotState, dist: Dist, kernels: Optional[StepKernels] = None, top_logprobs: int = 0):
        """`top_logprobs`: how many most likely tokens a step with log-probabilities returns per emitted token (the
        engine's limit; each request takes its own first few)."""
        self.model, self.proposer, self.cache, self.state, self.dist = model, proposer, cache, state, dist
        self.kernels = kernels or StepKernels()
        self.top_logprobs = top_logprobs

    # ---- phases ----------------------------------------------------------------------------------------
    def verify(self, slots: torch.Tensor, key_blocks: torch.Tensor, tokens: torch.Tensor, offsets: torch.Tensor,
               mask: torch.Tensor, with_logits: bool = True, prompt_len: Optional[torch.Tensor] = None) -> Verified:
        """Base model over [bs, T] new tokens at positions ctx_len + offsets (tree attention).

        key_blocks [nblk]: its length is how many KV blocks per request the torch attention reads (a multiple of
        the block size covering every request's ctx_len + T); the Triton kernel reads exactly what it needs.
        prompt_len [bs] (prompt steps only): each request's prompt length, which dynamic-NTK RoPE rotates its prompt
        tokens with (`AttentionMeta.prompt_len`).
        """
        st = self.state
        ctx = st.ctx_len[slots]  # [bs]
        T = tokens.shape[1]
        write_pos = ctx[:, None] + torch.arange(T, device=ctx.device)  # [bs, T] packed token p at ctx + p
        table = self.cache.block_table[slots][:, :key_blocks.shape[0]]  # [bs, nblk]
        full = self.cache.block_table[slots]  # write addresses may lie past the keys read (torch path)
        bsz = self.cache.block_size
        write_slots = full.gather(1, write_pos // bsz) * bsz + write_pos % bsz  # [bs, T]
        meta = AttentionMeta(positions=ctx[:, None] + offsets, write_slots=write_slots, block_table=table,
                             ctx_len=ctx, tree_mask=mask, block_size=bsz, prompt_len=prompt_len)
        hidden = self.model(tokens, meta, (self.cache.k, self.cache.v))  # [bs, T, H]
        return Verified(hidden=hidden, logits=self.model.logits(hidden) if with_logits else hidden[..., :0])

    def verify_tree(self, slots: torch.Tensor, key_blocks: torch.Tensor, tree_width: torch.Tensor) -> Verified:
        """verify over the slots' stored draft trees, cut to their first T = len(tree_width) nodes (the best T: trees
        are numbered best first; padding positions are harmless)."""
        st, w = self.state, tree_width  # index_select by arange(P), not [:, :P]: a strided slice would make
        # torch.compile specialize P while checking contiguity
        tokens = st.tree_tokens[slots].index_select(1, w)
        # the root is the true token: the stored tree's own root, unless an AR step came after the tree was drafted
        tokens = torch.where(w[None, :] == 0, st.true_tok[slots][:, None], tokens)
        return self.verify(slots, key_blocks, tokens, st.tree_offsets[slots].index_select(1, w),
                           st.tree_mask[slots].index_select(1, w).index_select(2, w))

    def targets(self, slots: torch.Tensor, logits: torch.Tensor, offsets: torch.Tensor, rule: AcceptanceRule,
                grammar: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The target's token after each of the [bs, T] nodes -> (tokens [bs, T], probs [bs, T, V] or None).

        greedy: argmax. Any other rule: process the logits with each request's parameters and draw with the noise
        of the drawn token's position, ctx_len + depth + 1 (greedy rows get their argmax through a one-hot).
        grammar [bs, T, words]: each node's token bitmask (decoding/bitmask.py), applied to its logits first.
        """
        if grammar is not None:
            logits = bitmask.apply(logits, grammar)
        if rule is AcceptanceRule.GREEDY:
            return logits.argmax(dim=-1), None
        st = self.state
        bs, T, V = logits.shape
        rep = lambda x: x[slots][:, None].expand(bs, T).reshape(bs * T)  # noqa: E731  per-request -> per-node
        probs = sampling.process_logits(logits.reshape(bs * T, V), rep(st.temperature), rep(st.top_k), rep(st.top_p))
        position = (st.ctx_len[slots][:, None] + offsets + 1).reshape(bs * T)
        tokens = self.kernels.draw(probs, rep(st.seed), position).view(bs, T)
        return tokens, probs.view(bs, T, V)

    def accept(self, slots: torch.Tensor, logits: torch.Tensor, rule: AcceptanceRule, keep: torch.Tensor,
               grammar: Optional[torch.Tensor] = None) -> Accepted:
        """Choose beam, accepted count and next token for every request among its first keep [bs] (<= T) tree nodes;
        pack the emitted tokens. A node past `keep` is never accepted: its drafted token is replaced by -1, which no
        target token equals (`apple` rows verify whole trees: the policy gives them keep = T = P). grammar
        [bs, nb, bl, words]: the token bitmask of the tree node at each beam position (runtime/grammar.py)."""
        st = self.state
        P = logits.shape[1]
        beams, unpacker = st.beams[slots], st.unpacker[slots]  # [bs, nb, bl]
        offsets = st.tree_offsets[slots].index_select(1, torch.arange(P, device=slots.device))
        node_mask = node_rows(grammar, unpacker, P) if grammar is not None else None
        node_tok, probs = self.targets(slots, logits, offsets, rule, node_mask)  # [bs, P]
        beams = torch.where(unpacker < keep[:, None, None], beams, -1)
        unpacker = unpacker.clamp(max=P - 1)  # pruned positions read some verified node's value: never used
        acc = self.kernels.accept_tokens(beams, tree.unpack(unpacker, node_tok))  # tokens in beam layout
        if rule is AcceptanceRule.APPLE:
            target_logp = tree.unpack(unpacker, probs).log()  # [bs, nb, bl, V]
            apple = acceptance.accept_apple(beams, target_logp, st.draft_logp[slots], st.seed[slots], st.ctx_len[slots])
            use = st.apple[slots]
            acc = Acceptance(*(torch.where(use, a, e) for a, e in zip(apple.pack(), acc.pack())))
        acc = Acceptance.unpack(self.dist.broadcast(acc.pack()))
        tokens, lengths = acceptance.emitted_tokens(beams, acc)  # [bs, bl], [bs]
        return Accepted(decision=acc.pack(), emitted=torch.cat([tokens, lengths[:, None]], dim=1))

    def rewind(self, slots: torch.Tensor, decision: torch.Tensor) -> torch.Tensor:
        """Keep the accepted path's K/V (move path entries to ctx+1..ctx+n), advance ctx_len and the true token.

        -> path [bs, bl]: packed indices of the root and the accepted tokens (0 past them); path[num_accepted] is the
        last accepted token, whose hidden state the drafter reads.
        """
        st, cache = self.state, self.cache
        acc = Acceptance.unpack(decision)
        # packed indices of the root and the accepted tokens along the chosen beam (increasing), 0 past them
        path, _ = tree.path_packed_indices(st.unpacker[slots], acc.beam_index, acc.num_accepted + 1)  # [bs, bl]
        m = torch.arange(path.shape[1], device=slots.device)[None, :]
        keep = m <= acc.num_accepted[:, None]  # [bs, bl] root + accepted tokens
        ctx = st.ctx_len[slots]
        src_pos = ctx[:, None] + torch.where(keep, path, m)  # positions past the path move onto themselves
        dst_pos = ctx[:, None] + m
        table, bsz = cache.block_table[slots], cache.block_size
        src = table.gather(1, src_pos // bsz) * bsz + src_pos % bsz  # [bs, bl]
        dst = table.gather(1, dst_pos // bsz) * bsz + dst_pos % bsz
        self.kernels.move_kv([*cache.k, *cache.v], src, dst)
        st.advance(slots, ctx + acc.num_accepted + 1, acc.next_token)
        return path

    def draft(self, hidden: torch.Tensor, path: torch.Tensor, decision: torch.Tensor, keep_log_probs: bool,
              draft_beams: Optional[torch.Tensor] = None, draft_depth: Optional[list[torch.Tensor]] = None
              ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """The proposer's beams [bs, nb, bl], their quantized scores [bs, nb, dl] (and drafter log-probs for `apple`)
        for each request's next tree; `draft_beams` [k]: draft k <= nb beams, `draft_depth`: stop the search early
        (`_propose`)."""
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        acc = Acceptance.unpack(decision)
        return self._propose(hidden[rows, path[rows, acc.num_accepted]], acc.next_token, keep_log_probs,
                             draft_beams, draft_depth)

    def _propose(self, h: torch.Tensor, true_token: torch.Tensor, keep_log_probs: bool,
                 draft_beams: Optional[torch.Tensor] = None, draft_depth: Optional[list[torch.Tensor]] = None
                 ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """The beam search from h [bs, H] and the true tokens. `draft_beams` [k] (its length is what counts: an
        unbacked size under inductor, so one compiled step drafts any k): search k beams instead of nb, and fill the
        other nb - k with copies of beam 0, which `pack_beams` dedups. The tree is then the k-beam search's: what
        drafting costs shrinks with k (every depth runs the drafter over k rows), and shapes stay [bs, nb, ...].
        `draft_depth` (dl - 1 index tensors: `beam_search`'s `depth_rows`, over the bs * k rows): the search stops
        after d <= dl drafted tokens, and the nodes past depth d score SCORE_PAD, below every drafted node, as padding
        does, so they come last in the tree and the host sees where the search stopped (what drafting costs shrinks
        with d: every depth reads the drafter's weights once)."""
        nb = self.proposer.num_beams
        k = nb if draft_beams is None else draft_beams.shape[0]
        res = self.proposer.draft(h, true_token, keep_log_probs, draft_beams, draft_depth)
        if draft_beams is not None:
            j = torch.arange(nb, device=h.device)
            fill = torch.where(j < k, j, 0)  # beam j, or beam 0 where the search had fewer
            res = BeamSearchResult(*(None if x is None else x.index_select(1, fill)
                                     for x in (res.beams, res.log_probs, res.scores)))
        bl = res.beams.shape[2]
        scores = quantize_scores(res.scores)
        if draft_depth is not None:  # [dl]: whether the search ran at each depth (the first always does)
            ran = torch.stack([torch.ones((), dtype=torch.bool, device=h.device)] +
                              [beam_search.runs(idx) for idx in draft_depth])
            scores = torch.where(ran, scores, SCORE_PAD)
        # beams and scores in one collective: every rank orders the tree by rank 0's scores
        both = self.dist.broadcast(torch.cat([res.beams, scores], dim=2).contiguous())
        return both[:, :, :bl], both[:, :, bl:], res.log_probs

    def pack(self, slots: torch.Tensor, beams: torch.Tensor, scores: torch.Tensor, log_probs: Optional[torch.Tensor]
             ) -> torch.Tensor:
        """Dedup the beams into the next packed tree, padded to P, numbered best node first by `scores` [bs, nb, dl]
        (quantized), and store it in the slot rows -> [bs, 1 + 2P]: lengths, node scores best first, and each node's
        first beam position i * bl + j (beam i, the lowest through the node; depth j)."""
        packed = self.kernels.pack_beams(beams, pad_to=self.state.max_tree_tokens)
        packed, node = tree.order_by_score(packed, tree.node_scores(packed, scores, SCORE_PAD))
        self.state.store_tree(slots, beams, scores, packed, log_probs)
        return torch.cat([packed.lengths[:, None], node, packed.beam_positions], dim=1)

    def pack_host(self, slots: torch.Tensor, host_beams: torch.Tensor, host_scores: torch.Tensor,
                  host_mask: torch.Tensor) -> None:
        """Pack the trees the host composed (rows where host_mask; the others repack their stored beams and scores,
        which gives their stored tree back)."""
        st = self.state
        both = self.dist.broadcast(torch.cat([host_beams, host_scores], dim=2).contiguous())
        bl = host_beams.shape[2]
        use = host_mask[:, None, None]
        self.pack(slots, torch.where(use, both[:, :, :bl], st.beams[slots]),
                  torch.where(use, both[:, :, bl:], st.scores[slots]), None)

    # ---- whole steps -----------------------------------------------------------------------------------
    def redrafter_step(self, slots: torch.Tensor, key_blocks: torch.Tensor, tree_width: torch.Tensor,
                       keep: torch.Tensor, rule: AcceptanceRule, draft: bool, return_beams: bool = False,
                       logprobs: bool = False, host_beams: Optional[torch.Tensor] = None,
                       host_scores: Optional[torch.Tensor] = None, host_mask: Optional[torch.Tensor] = None,
                       grammar: Optional[torch.Tensor] = None, draft_beams: Optional[torch.Tensor] = None,
                       draft_depth: Optional[list[torch.Tensor]] = None, run: Optional[Callable] = None
                       ) -> torch.Tensor:
        """One speculative step for [bs] slots over the first T = len(tree_width) nodes of their trees, of which each
        request keeps keep [bs] -> [bs, RowLayout(...).width] rows (RowLayout).

        Drafts composed on the host (N-gram proposers, mixed trees, test oracles) arrive as `host_beams` [bs, nb, bl]
        and `host_scores` [bs, nb, dl] (quantized) for the rows in `host_mask` [bs] and are packed first. `draft` runs
        the device proposer after rewind and packs its beams into the next trees; `return_beams` also returns them,
        for the host to compose mixed trees with. `run(name, phase, *args)` calls each phase: directly by default;
        the engine's phase profile passes one that runs each phase as its own timed unit. `grammar`
        [bs, nb, bl, words]: token bitmasks of the tree's nodes, in beam layout (structured output; `accept`).
        `draft_beams` [k]: the next trees are drafted with k beams (`_propose`; None: nb); `draft_depth`: to a depth
        d <= dl (`_propose`; None: dl).
        """
        run = run or _call
        if host_beams is not None:
            run("pack", self.pack_host, slots, host_beams, host_scores, host_mask)
        v = run("verify", self.verify_tree, slots, key_blocks, tree_width)
        a = run("accept", self.accept, slots, v.logits, rule, keep, grammar)
        path = run("rewind", self.rewind, slots, a.decision)
        out = [a.emitted, torch.zeros_like(slots)[:, None], path]
        if draft:
            apple = rule is AcceptanceRule.APPLE
            beams, scores, log_probs = run("draft", self.draft, v.hidden, path, a.decision, apple, draft_beams,
                                           draft_depth)
            packed = run("pack", self.pack, slots, beams, scores, log_probs)  # [bs, 1 + 2P]
            out[1] = packed[:, :1]
            out.append(packed[:, 1:])
            if return_beams:
                out += [beams.flatten(1), scores.flatten(1)]
        if logprobs:
            rows = torch.arange(path.shape[0], device=path.device)[:, None]
            out.append(self.encode_logprobs(v.logits[rows, path], a.emitted[:, :-1]))
        return torch.cat(out, dim=1)

    def encode_logprobs(self, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Row columns of the log-probabilities of tokens [bs, n], chosen from logits [bs, n, V] (logprobs.encode)."""
        return logprob_columns(logits, tokens, self.top_logprobs)

    def ar_step(self, slots: torch.Tensor, key_blocks: torch.Tensor, rule: AcceptanceRule, logprobs: bool = False,
                grammar: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One auto-regressive step for [bs] slots -> [bs, 3]: the next token, 1 (tokens emitted), 0 (no tree); and
        with `logprobs` the next token's log-probability columns. grammar [bs, words]: the token bitmasks."""
        st = self.state
        bs = slots.shape[0]
        tok = st.true_tok[slots][:, None]  # [bs, 1]
        zeros = torch.zeros_like(tok)
        mask = torch.ones(bs, 1, 1, dtype=torch.bool, device=tok.device)
        v = self.verify(slots, key_blocks, tok, zeros, mask)
        if st.hidden is not None:  # the hidden state that predicted `nxt` (a distillation corpus reads it back)
            put_rows(st.hidden, slots, v.hidden[:, 0])
        nxt, _ = self.targets(slots, v.logits, zeros, rule, grammar[:, None] if grammar is not None else None)
        nxt = self.dist.broadcast(nxt.contiguous())
        st.advance(slots, st.ctx_len[slots] + 1, nxt[:, 0])
        out = [nxt, torch.ones_like(nxt), zeros]
        if logprobs:
            out.append(self.encode_logprobs(v.logits, nxt))
        return torch.cat(out, dim=1)

    def prefill(self, slots: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor, rule: AcceptanceRule,
                prompt_len: Optional[torch.Tensor] = None, start: Optional[torch.Tensor] = None,
                longest_start: int = 0, logprobs: bool = False, grammar: Optional[torch.Tensor] = None
                ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Prompt step for [bs] new requests: ids [bs, T] right-padded, lengths [bs] -> (hidden of the last prompt
        token [bs, H], with `logprobs` the first token's log-probability columns [bs, columns] else None); sets
        ctx_len and the first true token (drawn at position start + lengths).

        prompt_len [bs]: how many of each row's tokens are its prompt (default: all of them); fewer when a preempted
        request recomputes its prompt and output (dynamic-NTK RoPE rotates the two differently, see rope.py).
        start [bs] (default 0): positions whose K/V the request already holds (a reused prefix, kv_cache.py): its
        ids are the tokens after them, attending to them as to committed context; `longest_start` is their max.
        grammar [bs, words]: the first token's bitmasks (structured output)."""
        st = self.state
        bs = ids.shape[0]
        dev = ids.device
        start = torch.zeros_like(slots) if start is None else start
        v = self._write_prompt(slots, ids, lengths, start, longest_start,
                               lengths if prompt_len is None else prompt_len)
        rows = torch.arange(bs, device=dev)
        last = lengths - 1
        h = v.hidden[rows, last]  # [bs, H]
        if st.hidden is not None:
            put_rows(st.hidden, slots, h)
        # the draw at the last prompt position: same noise as an AR step there (position = start + lengths)
        offsets = last[:, None]  # ctx_len is start, so position = start + offset + 1
        logits = self.model.logits(h)[:, None]  # [bs, 1, V]
        nxt, _ = self.targets(slots, logits, offsets, rule, grammar[:, None] if grammar is not None else None)
        nxt = self.dist.broadcast(nxt[:, 0].contiguous())
        st.advance(slots, start + lengths, nxt)
        return h, self.encode_logprobs(logits, nxt[:, None]) if logprobs else None

    def prefill_chunk(self, slots: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor, start: torch.Tensor,
                      longest_start: int, prompt_len: Optional[torch.Tensor] = None) -> None:
        """A prompt chunk that does not end the prompt (chunked prefill): the K/V of ids [bs, T] (right-padded,
        lengths [bs]) at positions start + t, attending to the `start` positions already held, as `prefill` writes
        them; ctx_len becomes start + lengths, and nothing is drawn."""
        self._write_prompt(slots, ids, lengths, start, longest_start, prompt_len)
        put_rows(self.state.ctx_len, slots, start + lengths)

    def _write_prompt(self, slots: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor, start: torch.Tensor,
                      longest_start: int, prompt_len: Optional[torch.Tensor]) -> Verified:
        """The base model over prompt tokens ids [bs, T] (right-padded, lengths [bs]) at positions start + t, causal
        among themselves and attending to the `start` positions each request already holds; their K/V written."""
        bs, T = ids.shape
        dev = ids.device
        put_rows(self.state.ctx_len, slots, start)
        ar = torch.arange(T, device=dev)
        valid = ar[None, :] < lengths[:, None]  # [bs, T]
        causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
        mask = (causal[None] & valid[:, None, :] & valid[:, :, None]) | torch.eye(T, dtype=torch.bool, device=dev)
        key_blocks = torch.arange(-(-(longest_start + T) // self.cache.block_size), device=dev)
        return self.verify(slots, key_blocks, ids, ar[None, :].expand(bs, T), mask, with_logits=False,
                           prompt_len=prompt_len)

    def draft_from_prompt(self, slots: torch.Tensor, h: torch.Tensor, keep_log_probs: bool) -> torch.Tensor:
        """Draft + pack the first tree of newly prefilled requests (their true token is in the slot state) ->
        [bs, 1 + 2P]: each tree's length, its node scores best first and their beam positions (`pack`)."""
        return self.pack(slots, *self._propose(h, self.state.true_tok[slots], keep_log_probs))
