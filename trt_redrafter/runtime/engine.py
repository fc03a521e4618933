"""The torch engine: one ReDrafter (or auto-regressive) step over a batch of requests.

A step, per generating request, mirrors what TensorRT-LLM puts in one engine call:
    1. verify   run the base model over the request's packed draft tree (tree attention)
    2. accept   choose the beam and how many of its drafted tokens survive, plus the next true token
    3. rewind   keep only the accepted path's KV entries
    4. draft    drafter beam search from the hidden state at the last accepted position and the true token
    5. pack     dedup the beams' shared prefixes into the next packed tree
Requests still in their prompt phase are processed in the same step (mixed batch): their prompt is the span,
their last logits give the first true token, and they draft right away. AR requests feed one token per step.

Every rank runs the same step on its shard; rank 0's decisions (accepted tokens, drafts) are broadcast so TP
ranks can never drift apart, whatever the floating-point reduction order.

The engine knows nothing about text: token ids in, token ids out.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..config import BuildConfig, SamplingConfig, torch_dtype
from ..decoding import acceptance, beam_search, sampling
from ..errors import UserError
from ..log import get_logger
from ..model.attention import AttentionBatch, SpanSpec, causal_mask
from ..model.drafter import DrafterRank
from ..model.llama import LlamaRank
from .distributed import Dist
from .engine_config import EngineConfig, load_engine_config
from .kv_cache import PagedKVCache
from .sequence import Sequence, attach_drafts

logger = get_logger(__name__)

APPLE_WARP_TOP_K = 50  # Apple's drafter keeps its 50 most likely tokens before the beam search


@dataclass
class StepEvent:
    """What one step did for one request (streamed to clients)."""

    seq_id: int
    new_tokens: list[int]
    finished: bool


class Engine:
    def __init__(self, engine_dir: str | Path, dist: Dist, drafter_semantics: str = "apple",
                 kv_cache_tokens: int | None = None, dtype: str | None = None):
        self.engine_dir = Path(engine_dir)
        self.cfg: EngineConfig = load_engine_config(self.engine_dir)
        info = self.cfg.checkpoint
        if info.tp_size != dist.world_size:
            raise UserError(f"engine {self.engine_dir} was built for tp={info.tp_size} but {dist.world_size} "
                            f"rank(s) are running; launch with mpirun -n {info.tp_size}.")
        self.dist = dist
        self.redrafter = info.redrafter
        self.build: BuildConfig = self.cfg.build
        self.dtype = torch_dtype(dtype or self.build.dtype or info.model.dtype)
        path = self.engine_dir / f"rank{dist.rank}.safetensors"
        if not path.is_file():
            raise UserError(f"engine {self.engine_dir} has no {path.name}; rebuild it with build-engine.")
        tensors = load_file(str(path))
        max_pos = self.build.max_seq_len + self.redrafter.max_tree_tokens
        self.model = LlamaRank(info.model, tensors, dist, self.dtype, max_pos)
        self.drafter = DrafterRank(info.drafter, tensors, dist, self.dtype, drafter_semantics)
        self.drafter_semantics = drafter_semantics
        del tensors
        m = info.model
        kv_heads = max(m.num_key_value_heads // dist.world_size, 1)
        bs = self.build.kv_block_size
        per_seq = self.build.max_seq_len + self.redrafter.max_tree_tokens  # a full request plus one draft tree
        tokens = kv_cache_tokens or self.build.max_tokens_in_paged_kv_cache or per_seq * self.build.max_batch_size
        num_blocks = -(-tokens // bs)
        self.cache = PagedKVCache(m.num_hidden_layers, num_blocks, bs, kv_heads, m.head_size, self.dtype, dist.device)
        self._ids = itertools.count()

    # ---- requests --------------------------------------------------------------------------------------------
    def new_sequence(self, prompt: list[int], params: SamplingConfig, mode: str = "redrafter",
                     stop_ids: tuple[int, ...] = (), seq_id: int | None = None,
                     stop_sequences: tuple[tuple[int, ...], ...] = ()) -> Sequence:
        """Validate a request against the engine's limits and make its state."""
        if mode not in ("redrafter", "ar"):
            raise UserError(f"mode must be 'redrafter' or 'ar', got {mode!r}.")
        if not prompt:
            raise UserError("the prompt is empty; give at least one token.")
        if len(prompt) > self.build.max_input_len:
            raise UserError(f"the prompt has {len(prompt)} tokens but the engine's max_input_len is "
                            f"{self.build.max_input_len}; shorten it or rebuild with a larger --max-input-len.")
        vocab = self.cfg.checkpoint.model.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise UserError(f"prompt token id(s) {bad[:5]} are outside the vocabulary [0, {vocab}).")
        if params.max_tokens > self.build.max_seq_len - len(prompt):
            raise UserError(f"max_tokens={params.max_tokens} with a {len(prompt)}-token prompt exceeds the engine's "
                            f"max_seq_len={self.build.max_seq_len}; ask for at most "
                            f"{self.build.max_seq_len - len(prompt)} tokens.")
        gen = torch.Generator(device=self.dist.device)  # sampling draws on the device the probabilities live on
        gen.manual_seed(params.seed)
        sid = next(self._ids) if seq_id is None else seq_id
        return Sequence(sid, list(prompt), params, mode, frozenset(stop_ids), self.build.max_seq_len, gen,
                        stop_sequences=tuple(tuple(q) for q in stop_sequences if q))

    def release(self, seq: Sequence) -> None:
        self.cache.free(seq.seq_id)

    def restart(self, seq: Sequence) -> None:
        """Forget `seq`'s KV state (after preemption); its next step recomputes prompt + output so far."""
        self.cache.free(seq.seq_id)
        seq.ctx_len, seq.pending, seq.draft = 0, None, None

    def tokens_needed(self, seq: Sequence) -> int:
        """KV positions `seq` needs for its next step."""
        if seq.in_prompt_phase:
            return len(seq.prompt) + len(seq.output)
        if seq.draft is not None:
            return seq.ctx_len + int(seq.draft.tokens.numel())
        return seq.ctx_len + 1

    # ---- the step --------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, seqs: list[Sequence]) -> list[StepEvent]:
        assert seqs and all(not s.finished for s in seqs), [s.seq_id for s in seqs]
        dev = self.dist.device
        spans, ids = [], []
        for s in seqs:
            self.cache.reserve(s.seq_id, self.tokens_needed(s))
            if s.in_prompt_phase:  # prompt (+ output, when resuming after preemption)
                toks = torch.tensor(s.prompt + s.output)
                spans.append(SpanSpec(s.seq_id, 0, torch.arange(len(toks)), causal_mask(len(toks))))
            elif s.draft is not None:
                toks = s.draft.tokens
                spans.append(SpanSpec(s.seq_id, s.ctx_len, s.ctx_len + s.draft.offsets, s.draft.mask))
            else:
                toks = torch.tensor([s.pending])
                spans.append(SpanSpec(s.seq_id, s.ctx_len, torch.tensor([s.ctx_len]), causal_mask(1)))
            ids.append(toks)
        batch = AttentionBatch.build(spans, self.cache)
        hidden = self.model.forward(torch.cat(ids).to(dev), batch, self.cache)  # [N, H]  -- 1. verify

        # rows whose logits are needed: the whole tree for drafts, the last token otherwise
        rows = []
        for s, start, q in zip(seqs, batch.q_starts, batch.q_lens):
            rows.append(torch.arange(start, start + q) if s.draft is not None else torch.tensor([start + q - 1]))
        logits = self.model.logits(hidden[torch.cat(rows).to(dev)])  # [M, V] float32

        decision = self._accept(seqs, logits, [len(r) for r in rows])  # [bs, 3] beam, n_accepted, next -- 2.
        decision = self.dist.broadcast(decision.to(dev)).cpu()

        events, to_draft, h_rows = [], [], []
        for s, (beam, n, nxt), start in zip(seqs, decision.tolist(), batch.q_starts):
            if s.draft is not None:  # 3. rewind: keep the root and the n accepted tokens of the chosen beam
                path = s.draft.unpacker[beam, :n + 1]  # [n + 1] packed indices
                self.cache.compact(s.seq_id, s.ctx_len, path)
                emitted = s.draft.beams[beam, 1:n + 1].tolist() + [nxt]
                s.ctx_len += n + 1
                h_row = start + int(path[-1])
                s.stats.accepted_draft_tokens += n
                s.stats.draft_tokens += self.redrafter.draft_len_per_beam
            elif s.in_prompt_phase:
                n_ctx = len(s.prompt) + len(s.output)
                emitted, h_row = [nxt], start + n_ctx - 1
                s.ctx_len = n_ctx
            else:
                emitted, h_row = [nxt], start
                s.ctx_len += 1
            was_prompt = s.stats.first_token_time is None
            appended = s.append(emitted)
            now = time.perf_counter()
            if was_prompt:
                s.stats.first_token_time = now
            else:
                s.stats.steps += 1
                s.stats.generated_in_steps += len(appended)
            s.pending, s.draft = nxt, None
            events.append(StepEvent(s.seq_id, appended, s.finished))
            if not s.finished and s.mode == "redrafter":
                to_draft.append(s)
                h_rows.append(h_row)
        if to_draft:
            self._draft(to_draft, hidden[torch.tensor(h_rows, device=dev)])  # 4. draft + 5. pack
        return events

    # ---- accept -------------------------------------------------------------------------------------------
    def _accept(self, seqs: list[Sequence], logits: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """-> LongTensor[bs, 3]: (beam index, drafted tokens accepted, next true token) per request."""
        out = torch.zeros(len(seqs), 3, dtype=torch.long)
        per_seq = list(torch.split(logits, counts))
        single = [i for i, s in enumerate(seqs) if s.draft is None]
        if single:  # prompt step or AR step: sample the next token from the last position
            last = torch.cat([per_seq[i] for i in single])  # [k, V]
            probs = self._process([seqs[i].sampling for i in single], last)
            out[single, 2] = sampling.sample(probs, [seqs[i].generator for i in single]).cpu()
        for mode in ("greedy", "exact", "apple"):
            idx = [i for i, s in enumerate(seqs) if s.draft is not None and s.sampling.resolved_acceptance == mode]
            if not idx:
                continue
            dev = logits.device
            beams = torch.stack([seqs[i].draft.beams for i in idx]).to(dev)  # [g, nb, bl]

            def unpack(rows: list[torch.Tensor]) -> torch.Tensor:
                """Per-request packed-tree rows [P_i, V] -> beam layout [g, nb, bl, V]."""
                return torch.stack([r[seqs[i].draft.unpacker.to(dev)] for r, i in zip(rows, idx)])

            if mode == "greedy":
                acc = acceptance.accept_greedy(beams, unpack([per_seq[i] for i in idx]))
            else:
                # process each tree node once (beams sharing a prefix share its rows), then unpack
                params = [seqs[i].sampling for i in idx for _ in range(counts[i])]
                probs = self._process(params, torch.cat([per_seq[i] for i in idx]))  # [sum P_i, V]
                probs = unpack(list(torch.split(probs, [counts[i] for i in idx])))  # [g, nb, bl, V]
                gens = [seqs[i].generator for i in idx]
                if mode == "exact":
                    acc = acceptance.accept_exact(beams, probs, gens)
                else:
                    draft_logp = torch.stack([seqs[i].draft.log_probs for i in idx]).to(dev)
                    acc = acceptance.accept_apple(beams, probs.log(), draft_logp, gens)
            out[idx, 0] = acc.beam_index.cpu()
            out[idx, 1] = acc.num_accepted.cpu()
            out[idx, 2] = acc.next_token.cpu()
        return out

    def _process(self, params: list[SamplingConfig], logits: torch.Tensor) -> torch.Tensor:
        dev = logits.device
        temp = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
        top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=dev)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
        return sampling.process_logits(logits, temp, top_k, top_p)

    # ---- draft + pack ------------------------------------------------------------------------------------------
    def _draft(self, seqs: list[Sequence], h: torch.Tensor) -> None:
        rd = self.redrafter
        true_tok = torch.tensor([s.pending for s in seqs], device=h.device)
        warp = APPLE_WARP_TOP_K if self.drafter_semantics == "apple" else None
        res = beam_search.beam_search(self.drafter, self.model.embed, h, true_tok, rd.num_beams,
                                      rd.draft_len_per_beam, warp_top_k=warp)
        beams = self.dist.broadcast(res.beams.contiguous()).cpu()  # [g, nb, bl]
        attach_drafts(seqs, beams, res.log_probs)
