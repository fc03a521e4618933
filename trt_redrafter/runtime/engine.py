"""The torch engine: load an engine directory, admit requests into batch slots, run batched steps.

`Engine.step(seqs)` runs one step for every given request, grouped by what they need:
    prompt phase   `DecodeStep.prefill` (eager; a request's prompt runs once), then the first draft
    ReDrafter      `DecodeStep.redrafter_step`: verify -> accept -> rewind -> draft -> pack (step.py)
    AR             `DecodeStep.ar_step`
The decode steps run through `graphs.Unit`s (eager, inductor, CUDA graphs per batch bucket) and read their state
from the device (`SlotState`, the paged KV cache's block table); the host reads back one small tensor per group,
the emitted tokens, and does the bookkeeping (stop conditions, statistics, streaming events).

Each speculative request has a proposer (config.PROPOSERS; the engine's default, or its own):
    redrafter  the drafter's beams, drafted and packed inside the step (no host work)
    ngram      N-gram drafts (runtime/ngram.py) composed on the host after the read-back
    mixed      the drafter's beams, packed inside the step and read back with the emitted tokens; when the context
               has N-gram matches, the host puts them in place of the lowest-ranked beams
Trees composed on the host are packed at the start of the request's next step, so every step is still one launch
and one read-back.

Every rank runs the same steps on its shard; rank 0's decisions are broadcast inside the step (step.py).
The engine knows nothing about text: token ids in, token ids out.
"""

from __future__ import annotations

import itertools
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file

from .. import cpu as cpu_kernels
from ..config import DECODING_MODES, PROPOSERS, BuildConfig, RuntimeConfig, SamplingConfig, torch_dtype
from ..errors import UserError
from ..log import get_logger
from ..model.drafter import DrafterRank
from ..model.attention import cpu_tree_attention
from ..model.linear import resolve_linear
from ..model.llama import LlamaRank
from .distributed import Dist
from .engine_config import EngineConfig, load_engine_config
from .graphs import Compiler, batch_buckets, bucket_for
from .kv_cache import PagedKVCache
from .ngram import NGRAMS_FILE, ModelNgrams, NgramProposer, packed_length
from .proposer import HostProposer, ReDrafterProposer
from .sequence import Sequence
from .state import SlotState
from .step import DecodeStep, StepKernels
from .timing import PhaseTimer

logger = get_logger(__name__)

PHASES = ("verify", "accept", "rewind", "draft", "pack")


@dataclass
class StepEvent:
    """What one step did for one request (streamed to clients)."""

    seq_id: int
    new_tokens: list[int]
    finished: bool


@dataclass
class StepTimes:
    """Wall time of decode steps by kind (launch to read-back, host bookkeeping excluded), for cost ratios; and
    under "propose" the host's drafting between steps (N-gram proposer, mixed trees)."""

    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    steps: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, kind: str, seconds: float) -> None:
        self.seconds[kind] += seconds
        self.steps[kind] += 1

    def mean_ms(self, kind: str) -> float:
        return 1e3 * self.seconds[kind] / self.steps[kind] if self.steps[kind] else 0.0

    def reset(self) -> None:
        self.seconds.clear()
        self.steps.clear()


class Engine:
    def __init__(self, engine_dir: str | Path, dist: Dist, runtime: RuntimeConfig | None = None,
                 proposer: Optional[HostProposer] = None, warmup: bool = True):
        self.engine_dir = Path(engine_dir)
        cfg = load_engine_config(self.engine_dir)
        if cfg.tp_size != dist.world_size:
            raise UserError(f"engine {self.engine_dir} was built for tp={cfg.tp_size} but {dist.world_size} "
                            f"rank(s) are running; launch with mpirun -n {cfg.tp_size}.")
        path = self.engine_dir / f"rank{dist.rank}.safetensors"
        if not path.is_file():
            raise UserError(f"engine {self.engine_dir} has no {path.name}; rebuild it with build-engine.")
        self._setup(cfg, load_file(str(path)), dist, runtime or RuntimeConfig(), proposer, warmup)

    @classmethod
    def from_tensors(cls, cfg: EngineConfig, tensors: dict[str, torch.Tensor], dist: Dist,
                     runtime: RuntimeConfig | None = None, proposer: Optional[HostProposer] = None,
                     warmup: bool = True) -> "Engine":
        """An engine over this rank's checkpoint tensors already in memory (benchmarks build random models in
        place); tensors already on the device in the compute dtype are used without a copy."""
        engine = cls.__new__(cls)
        engine.engine_dir = None
        engine._setup(cfg, tensors, dist, runtime or RuntimeConfig(), proposer, warmup)
        return engine

    def _setup(self, cfg: EngineConfig, tensors: dict[str, torch.Tensor], dist: Dist, runtime: RuntimeConfig,
               proposer: Optional[HostProposer], warmup: bool) -> None:
        self.cfg, self.runtime, self.dist = cfg, runtime, dist
        info = cfg.checkpoint
        if runtime.threads:
            torch.set_num_threads(runtime.threads)
        self.redrafter = rd = cfg.tree  # the draft-tree shape (nb x dl) every speculative step verifies
        self.build: BuildConfig = cfg.build
        self.dtype = torch_dtype(runtime.dtype or self.build.dtype or info.model.dtype)
        per_seq = self.build.max_seq_len + rd.max_tree_tokens  # a full request plus one draft tree
        self.linear = resolve_linear(runtime.linear, dist.device, self.dtype)  # "torch" | "onednn" | "avx512"
        t0 = time.perf_counter()
        self.model = LlamaRank(info.model, tensors, dist, self.dtype, per_seq, self.linear)
        semantics = runtime.drafter_semantics or self.build.drafter_semantics
        self.drafter = None
        if info.drafter is not None:
            d_dtype = torch_dtype(runtime.drafter_dtype) if runtime.drafter_dtype else self.dtype
            d_linear = self.linear if d_dtype == self.dtype else resolve_linear(runtime.linear, dist.device, d_dtype)
            self.drafter = DrafterRank(info.drafter, tensors, dist, d_dtype, semantics, d_linear)
        logger.info("model loaded in %.1fs (%s, linear layers: %s)", time.perf_counter() - t0, self.dtype,
                    self.linear)
        if self.drafter is not None and self.drafter.dtype != self.dtype:
            logger.info("drafter in %s (linear layers: %s)", self.drafter.dtype, self.drafter.linear)
        del tensors
        self.vocab_size = info.model.vocab_size

        m = info.model
        kv_heads = max(m.num_key_value_heads // dist.world_size, 1)
        bsz = self.build.kv_block_size
        # by default: max_batch_size requests of max_seq_len tokens plus a tree, each rounded up to whole blocks
        tokens = runtime.kv_cache_tokens or self.build.max_tokens_in_paged_kv_cache or \
            -(-per_seq // bsz) * bsz * self.build.max_batch_size
        num_slots = self.build.max_batch_size + 1  # + the padding slot
        self.cache = PagedKVCache(m.num_hidden_layers, -(-tokens // bsz), bsz, kv_heads, m.head_size, self.dtype,
                                  dist.device, max_slots=num_slots, max_blocks_per_seq=-(-per_seq // bsz))
        self.state = SlotState.allocate(num_slots, rd.num_beams, rd.draft_len_per_beam, dist.device)
        self._free_slots = list(range(num_slots - 2, -1, -1))  # pop() hands out slot 0 first

        self.kernels = self._resolve_kernels()
        select, kernels = None, StepKernels()
        if self.kernels == "triton":
            from .. import plugins

            self.model.attention_impl = plugins.tree_attention
            self.model.ops = plugins.fused
            select = plugins.beam_step
            kernels = StepKernels.triton([*self.cache.k, *self.cache.v], with_mover="inductor" not in runtime.compile)
        elif self.kernels == "cpu":
            self.model.attention_impl = cpu_tree_attention
        self.host_proposer = proposer  # tests' oracles: it drafts every speculative request's trees
        if proposer is not None:
            assert (proposer.num_beams, proposer.draft_len) == (rd.num_beams, rd.draft_len_per_beam), \
                f"proposer drafts {proposer.num_beams}x{proposer.draft_len}, engine trees are " \
                f"{rd.num_beams}x{rd.draft_len_per_beam}"
        self.device_proposer = ReDrafterProposer(self.drafter, self.model.embed, rd.num_beams, rd.draft_len_per_beam,
                                                 select=select) if self.drafter is not None else None
        table = self.engine_dir / NGRAMS_FILE if self.engine_dir is not None else None
        self.ngram = NgramProposer(rd.num_beams, rd.draft_len_per_beam, cfg.proposer,
                                   ModelNgrams.load(table, info.model.vocab_size) if table and table.is_file() else None)
        # when an N-gram request verifies a tree (ngram.py): auto = always on a GPU, adaptive on a CPU
        self.ngram_when = cfg.proposer.ngram_when if cfg.proposer.ngram_when != "auto" else (
            "always" if dist.device.type == "cuda" else "adaptive")
        self.steps = DecodeStep(self.model, self.device_proposer, self.cache, self.state, dist, kernels)
        self.compiler = Compiler(runtime.compile, dist.device, dist.world_size)
        self.buckets = batch_buckets(self.build.max_batch_size)
        self._units: dict[tuple, object] = {}
        self.timer = PhaseTimer(dist.device, enabled=runtime.profile_phases)
        self.step_times = StepTimes()
        self._step_ms: dict[str, float] = {}  # running mean of step time per kind: what a tree costs over AR
        self._ids = itertools.count()
        if warmup and self.compiler.mode != "off":
            self.warmup()

    def _resolve_kernels(self) -> str:
        want = self.runtime.kernels
        if want == "torch":
            return "torch"
        if self.dist.device.type != "cuda":
            if want == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
                raise UserError("--kernels triton needs a CUDA device (on the CPU the kernels run only under "
                                "TRITON_INTERPRET=1, in tests); use --kernels auto, cpu or torch.")
            if want != "triton":
                return self._resolve_cpu_kernels(want)
        elif want == "cpu":
            raise UserError(f"--kernels cpu runs on the CPU, but this engine runs on {self.dist.device}; use "
                            f"--kernels auto, triton or torch.")
        try:
            from .. import plugins  # noqa: F401
        except ImportError as e:
            if want == "triton":
                raise UserError(f"--kernels triton but the Triton kernels cannot load ({e}); pip install triton.") from e
            logger.warning("Triton kernels unavailable (%s); using the PyTorch path", e)
            return "torch"
        return "triton"

    def _resolve_cpu_kernels(self, want: str) -> str:
        """auto / cpu on the CPU -> "cpu" (trt_redrafter/cpu's tree attention) or "torch"."""
        why = None if cpu_kernels.available(self.dtype) else cpu_kernels.unavailable_reason(self.dtype)
        if why is None and not cpu_kernels.attention_supports(self.model.D):
            why = f"the model's head size {self.model.D} is not a multiple of 16 from 16 to 128"
        if why is not None:
            if want == "cpu":
                raise UserError(f"--kernels cpu: {why}; use --kernels auto or torch.")
            return "torch"
        try:
            cpu_kernels.ops()
        except UserError as e:
            if want == "cpu":
                raise
            logger.warning("%s; using the PyTorch attention", e)
            return "torch"
        return "cpu"

    # ---- requests --------------------------------------------------------------------------------------------
    def new_sequence(self, prompt: list[int], params: SamplingConfig, mode: str = "redrafter",
                     stop_ids: tuple[int, ...] = (), seq_id: int | None = None,
                     stop_sequences: tuple[tuple[int, ...], ...] = (), proposer: str | None = None) -> Sequence:
        """Validate a request against the engine's limits and make its state. `proposer` (redrafter, ngram, mixed)
        overrides the engine's default for this request."""
        if mode not in DECODING_MODES:
            raise UserError(f"mode must be one of {', '.join(DECODING_MODES)}, got {mode!r}.")
        proposer = proposer or self.cfg.proposer.proposer
        if proposer not in PROPOSERS:
            raise UserError(f"proposer must be one of {', '.join(PROPOSERS)}, got {proposer!r}.")
        if proposer != "ngram" and self.drafter is None:
            raise UserError(f"proposer {proposer!r} needs a drafter, and this engine was built without one; use "
                            f"proposer 'ngram' (or rebuild with --drafter DIR).")
        if mode == "redrafter" and proposer != "redrafter" and params.resolved_acceptance == "apple":
            raise UserError(f"acceptance 'apple' weighs each draft by the drafter's probabilities, which "
                            f"{proposer!r} drafts do not have; use acceptance 'exact' (distribution-exact).")
        if not prompt:
            raise UserError("the prompt is empty; give at least one token.")
        if len(prompt) > self.build.max_input_len:
            raise UserError(f"the prompt has {len(prompt)} tokens but the engine's max_input_len is "
                            f"{self.build.max_input_len}; shorten it or rebuild with a larger --max-input-len.")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise UserError(f"prompt token id(s) {bad[:5]} are outside the vocabulary [0, {self.vocab_size}).")
        if params.max_tokens > self.build.max_seq_len - len(prompt):
            raise UserError(f"max_tokens={params.max_tokens} with a {len(prompt)}-token prompt exceeds the engine's "
                            f"max_seq_len={self.build.max_seq_len}; ask for at most "
                            f"{self.build.max_seq_len - len(prompt)} tokens.")
        sid = next(self._ids) if seq_id is None else seq_id
        return Sequence(sid, list(prompt), params, mode, frozenset(stop_ids), self.build.max_seq_len,
                        stop_sequences=tuple(tuple(q) for q in stop_sequences if q), proposer=proposer)

    def release(self, seq: Sequence) -> None:
        """Give back `seq`'s KV blocks and batch slot."""
        self.cache.free(seq.seq_id)
        seq.pending_beams = None
        if seq.slot >= 0:
            self._free_slots.append(seq.slot)
            seq.slot = -1

    def restart(self, seq: Sequence) -> None:
        """Forget `seq`'s KV state (after preemption); its next step recomputes prompt + output so far."""
        self.release(seq)
        seq.ctx_len, seq.prefilled = 0, False

    def tokens_needed(self, seq: Sequence) -> int:
        """KV positions `seq` needs for its next step."""
        if seq.in_prompt_phase:
            return len(seq.prompt) + len(seq.output)
        if seq.mode == "redrafter":
            return seq.ctx_len + self.redrafter.max_tree_tokens  # the padded tree is written whole
        return seq.ctx_len + 1

    # ---- the step --------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, seqs: list[Sequence], tree_cost_ratio: Optional[float] = None) -> list[StepEvent]:
        """One step for every given request. `tree_cost_ratio` (default: this rank's measurement) is what the
        N-gram proposer weighs its next trees with; under TP every rank is given rank 0's."""
        assert seqs and all(not s.finished for s in seqs), [s.seq_id for s in seqs]
        for s in seqs:
            self.cache.reserve(s.seq_id, self.tokens_needed(s))
            if s.slot < 0:
                assert self._free_slots, "more admitted requests than batch slots"
                s.slot = self._free_slots.pop()
                self.cache.bind(s.seq_id, s.slot)
                self.state.set_params([s.slot], [s.sampling])
        self.cache.sync()
        prompt = [s for s in seqs if s.in_prompt_phase]
        kinds = {s.seq_id: self._step_kind(s) for s in seqs if not s.in_prompt_phase}
        groups = [(kind, [s for s in seqs if kinds.get(s.seq_id) == kind]) for kind in DECODING_MODES]
        launched = [(kind, g, self._launch(kind, g)) for kind, g in groups if g]  # all groups, then read back
        emitted: dict[int, list[int]] = {}
        compose: dict[int, Optional[list[int]]] = {}  # seq_id -> the device's beams (flat) or None: next tree on host
        bl = self.redrafter.beam_length
        for kind, group, (out, t0) in launched:
            rows = out.cpu().tolist()  # the step's one host sync
            dt = time.perf_counter() - t0
            self.step_times.add(kind, dt)
            self._step_ms[kind] = 0.9 * self._step_ms.get(kind, dt) + 0.1 * dt
            if kind == "ar":  # [token | 1 | 1]
                for s, row in zip(group, rows):
                    emitted[s.seq_id] = row[:1]
                    if self._on_host(s):  # a speculative request that had nothing to draft this step
                        compose[s.seq_id] = None
                continue
            for s, row in zip(group, rows):  # [tokens (bl) | count | next tree length | device beams (mixed)]
                emitted[s.seq_id] = row[:row[bl]]
                s.tree_len = row[bl + 1]
                if self._on_host(s):
                    compose[s.seq_id] = row[bl + 2:] or None
        if prompt:
            for s, (tok, tree_len) in zip(prompt, self._prefill(prompt, compose)):
                emitted[s.seq_id] = [tok]
                s.tree_len = tree_len

        events = []
        dl = self.redrafter.draft_len_per_beam
        for s in seqs:
            toks = emitted[s.seq_id]
            was_prompt = s.in_prompt_phase
            if was_prompt:
                s.prefilled, s.ctx_len = True, len(s.prompt) + len(s.output)
            else:
                s.ctx_len += len(toks)
                if kinds[s.seq_id] == "redrafter":
                    s.stats.accepted_draft_tokens += len(toks) - 1
                    s.stats.draft_tokens += dl
                    if s.proposer == "ngram":
                        self.ngram.observe(s, len(toks) - 1)
            appended = s.append(toks)
            now = time.perf_counter()
            if was_prompt:
                s.stats.first_token_time = now
            else:
                s.stats.steps += 1
                s.stats.generated_in_steps += len(appended)
            events.append(StepEvent(s.seq_id, appended, s.finished))
        self._compose_on_host([s for s in seqs if s.seq_id in compose and not s.finished], compose,
                              self.tree_cost_ratio() if tree_cost_ratio is None else tree_cost_ratio)
        return events

    # ---- trees composed on the host --------------------------------------------------------------------------
    def _step_kind(self, s: Sequence) -> str:
        """"redrafter" (verify a tree) or "ar": AR requests, and speculative ones with nothing drafted this step
        (an N-gram request with nothing worth verifying, `ngram_when`: tree_len 1 = the root alone)."""
        return "ar" if s.mode == "ar" or s.tree_len == 1 else "redrafter"

    def tree_cost_ratio(self) -> float:
        """What a tree step has been costing over an AR step (1 until both have run)."""
        ar, tree = self._step_ms.get("ar"), self._step_ms.get("redrafter")
        return tree / ar if ar and tree else 1.0

    def _on_host(self, s: Sequence) -> bool:
        """Whether `s`'s next tree is composed on the host (else drafted and packed inside the step)."""
        return s.mode == "redrafter" and (self.host_proposer is not None or s.proposer != "redrafter")

    def _drafts_on_device(self, proposers) -> bool:
        """Whether the drafter runs for requests with these proposer names (any that is not ngram)."""
        return self.host_proposer is None and self.drafter is not None and any(p != "ngram" for p in proposers)

    def _compose_on_host(self, seqs: list[Sequence], device_beams: dict[int, Optional[list[int]]],
                         cost_ratio: float) -> None:
        """The next tree of each of `seqs` (drafts, packed by its next step): the test oracle's, the N-gram
        proposer's, or (mixed) the device's beams with context N-gram matches in place of its lowest-ranked ones;
        a mixed request without a match keeps the tree the step packed."""
        if not seqs:
            return
        t0 = time.perf_counter()
        nb, bl = self.redrafter.num_beams, self.redrafter.beam_length
        if self.host_proposer is not None:
            beams = self.host_proposer.propose(seqs)
            assert beams.shape == (len(seqs), nb, bl), \
                f"host proposer returned {tuple(beams.shape)}, expected {(len(seqs), nb, bl)}"
            rows_of = beams.tolist()
        else:
            rows_of = []
            pc = self.cfg.proposer
            for s in seqs:
                if s.proposer == "ngram":  # []: nothing worth verifying
                    rows_of.append(self.ngram.drafts(s, self.ngram_when, cost_ratio) or [])
                    continue
                ctx = self.ngram.context_drafts(s, pc.ngram_beams, pc.mixed_min_match)
                if not ctx:
                    rows_of.append(None)  # the tree the step packed stays
                    continue
                flat = device_beams[s.seq_id]
                rows = [flat[i * bl:(i + 1) * bl] for i in range(nb)]
                ctx = [c for c in ctx if c not in rows]
                rows_of.append(rows[:nb - len(ctx)] + ctx if ctx else None)
        for s, rows in zip(seqs, rows_of):
            if rows:
                s.pending_beams, s.tree_len = rows, packed_length(rows)
            elif rows is not None:  # the next step is an AR step (`_step_kind`)
                s.pending_beams, s.tree_len = None, 1
        self.step_times.add("propose", time.perf_counter() - t0)

    def _rule(self, group: list[Sequence]) -> str:
        rules = {s.sampling.resolved_acceptance for s in group}
        if "apple" in rules and group[0].mode == "redrafter":
            return "apple"
        return "greedy" if rules == {"greedy"} else "sample"

    def _key_blocks(self, longest: int) -> torch.Tensor:
        """[nblk]: how many KV blocks per request the attention is given. All of them under CUDA graphs (static
        shapes) or with the Triton or CPU kernel (they stop at each request's length); else enough for `longest`
        positions, at least 2 so that inductor's one dynamic graph covers every length (size 1 would specialize)."""
        n = self.cache.max_blocks_per_seq
        if self._trims_key_blocks():
            n = min(max(2, -(-longest // self.cache.block_size)), n)
        return torch.arange(n, device=self.dist.device)

    def _trims_key_blocks(self) -> bool:
        """Whether steps pass only the KV blocks the longest request needs: for the torch attention, which reads every
        block it is given, outside CUDA graphs (static shapes). The kernels stop at each request's length."""
        return not (self.compiler.uses_graphs or self.kernels in ("triton", "cpu"))

    def _launch(self, kind: str, group: list[Sequence]) -> tuple[torch.Tensor, float]:
        """Start one decode step for `group` -> (its output rows on the device, maybe still running; start time)."""
        t0 = time.perf_counter()
        rule = self._rule(group)
        if rule == "apple":
            self.state.ensure_draft_logp(self.vocab_size)
        T = self._tree_width(group) if kind == "redrafter" else 1
        args = self._step_inputs([s.slot for s in group], T, max(s.ctx_len for s in group) + T)
        if kind == "ar":
            return self._unit(kind)(*args, rule, False)[:len(group)], t0
        draft = self._drafts_on_device(s.proposer for s in group)
        mixed = draft and any(s.proposer == "mixed" for s in group)  # the host needs the device's beams
        variant = (rule, draft, mixed, *self._host_inputs(group, args[0].shape[0]))
        if self.timer.enabled:  # each phase its own unit, timed
            out = self.steps.redrafter_step(*args, *variant, run=self._timed_phase)
            self.timer.end_step()
        else:
            out = self._unit(kind)(*args, *variant)
        return out[:len(group)], t0

    def _host_inputs(self, group: list[Sequence], n: int) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(host_beams [n, nb, bl], host_mask [n]) of the group's trees composed on the host (None if none); taken:
        the step packs them."""
        pending = [s.pending_beams for s in group]
        if all(p is None for p in pending):
            return None, None
        nb, bl = self.redrafter.num_beams, self.redrafter.beam_length
        empty = [[0] * bl] * nb
        rows = [p if p is not None else empty for p in pending] + [empty] * (n - len(group))
        mask = [p is not None for p in pending] + [False] * (n - len(group))
        for s in group:
            s.pending_beams = None
        dev = self.dist.device
        beams, mask = torch.tensor(rows, dtype=torch.long).to(dev), torch.tensor(mask).to(dev)
        self.compiler.mark_dynamic(beams, mask)
        return beams, mask

    def _step_inputs(self, slots: list[int], T: int, longest: int) -> tuple[torch.Tensor, ...]:
        """(slots, key_blocks, tree_width) of a decode step: slots padded to a batch bucket under CUDA graphs, and
        every varying size marked dynamic for inductor."""
        if self.compiler.uses_graphs:
            slots = slots + [self.state.padding_slot] * (bucket_for(len(slots), self.buckets) - len(slots))
        args = (torch.tensor(slots, dtype=torch.long, device=self.dist.device), self._key_blocks(longest),
                torch.arange(T, device=self.dist.device))
        # key_blocks varies only where the attention reads every block it is given (`_key_blocks`)
        self.compiler.mark_dynamic(*(args if self._trims_key_blocks() else args[::2]))
        return args

    def _tree_width(self, group: list[Sequence]) -> int:
        """Packed tokens a ReDrafter step verifies per request: the longest tree of the batch (the host knows the
        lengths: each step returns them), or max_tree_tokens under CUDA graphs (static shapes)."""
        P = self.redrafter.max_tree_tokens
        return P if self.compiler.uses_graphs else min(P, max(2, max(s.tree_len for s in group)))

    def _unit(self, kind: str):
        unit = self._units.get(kind)
        if unit is None:
            fn = self.steps.redrafter_step if kind == "redrafter" else self.steps.ar_step
            unit = self._units[kind] = self.compiler.unit(fn, f"{kind}-step", self._on_padding)
        return unit

    def _timed_phase(self, name: str, phase, *args):
        """One phase of a profiled step, run as its own unit (compiled / captured) and timed."""
        key = (name, phase.__name__)  # "pack" is the device's beams, or the host's (pack_host)
        unit = self._units.get(key)
        if unit is None:  # drafting writes no state: its capture needs no padding-slot arguments
            unit = self._units[key] = self.compiler.unit(phase, name, None if name == "draft" else self._on_padding)
        with self.timer.phase(name):
            return unit(*args)

    def _on_padding(self, slots: torch.Tensor, *rest):
        """The same call on padding slots only (what a CUDA-graph capture may run for real)."""
        return (torch.full_like(slots, self.state.padding_slot), *rest)

    def _prefill(self, seqs: list[Sequence], compose: dict[int, Optional[list[int]]]) -> list[tuple[int, int]]:
        """Prompt step (eager) for newly admitted (or preempted) requests -> (first true token, tree length); rows
        whose first tree the host composes go into `compose` (with the device's beams, where it drafted)."""
        dev = self.dist.device
        texts = [s.prompt + s.output for s in seqs]
        lengths = torch.tensor([len(t) for t in texts], dtype=torch.long)
        ids = torch.zeros(len(texts), int(lengths.max()), dtype=torch.long)
        for i, t in enumerate(texts):
            ids[i, :len(t)] = torch.tensor(t)
        slots = torch.tensor([s.slot for s in seqs], dtype=torch.long, device=dev)
        rule = self._rule(seqs)
        prompt_len = torch.tensor([len(s.prompt) for s in seqs], dtype=torch.long)  # < lengths after a preemption
        h = self.steps.prefill(slots, ids.to(dev), lengths.to(dev), rule, prompt_len.to(dev))
        rd = [i for i, s in enumerate(seqs) if s.mode == "redrafter" and self._drafts_on_device([s.proposer])]
        tree_len = [0] * len(seqs)
        if rd:
            if rule == "apple":
                self.state.ensure_draft_logp(self.vocab_size)
            idx = torch.tensor(rd, device=dev)
            for i, n in zip(rd, self.steps.draft_from_prompt(slots[idx], h[idx], rule == "apple").tolist()):
                tree_len[i] = n
        host = [i for i, s in enumerate(seqs) if self._on_host(s)]
        compose.update((seqs[i].seq_id, None) for i in host)
        drafted = [i for i in host if i in rd]  # mixed: the host composes with the device's beams, read once
        if drafted:
            flat = self.state.beams[slots[torch.tensor(drafted, device=dev)]].flatten(1).tolist()
            compose.update((seqs[i].seq_id, row) for i, row in zip(drafted, flat))
        return list(zip(self.state.true_tok[slots].tolist(), tree_len))

    # ---- warm-up ------------------------------------------------------------------------------------------
    def warmup(self) -> None:
        """Compile / capture the greedy decode steps of the engine's default proposer before the first request
        (padding-slot batches only; other proposers' variants compile when first asked for)."""
        t0 = time.perf_counter()
        sizes = self.buckets if self.compiler.uses_graphs else sorted({1, min(2, self.build.max_batch_size)})
        default = self.cfg.proposer.proposer
        draft = self._drafts_on_device([default])
        mixed = draft and default == "mixed"
        # (draft, return beams, host-composed trees in): see `_launch`; a mixed tree is host-composed on some steps
        variants = [(draft, mixed, False)] if default == "redrafter" and self.host_proposer is None else \
            [(draft, mixed, True)] + ([(draft, mixed, False)] if mixed else [])
        nb, bl = self.redrafter.num_beams, self.redrafter.beam_length
        with torch.inference_mode():
            for kind in DECODING_MODES:
                T = self.redrafter.max_tree_tokens if kind == "redrafter" else 1
                for bs in sorted(sizes, reverse=True):  # largest first: later captures reuse its pool memory
                    args = self._step_inputs([self.state.padding_slot] * bs, T, T)
                    if kind == "ar":
                        self._unit(kind)(*args, "greedy", False).cpu()
                        continue
                    for d, ret, host in variants:
                        beams = mask = None
                        if host:
                            beams = torch.zeros(bs, nb, bl, dtype=torch.long, device=self.dist.device)
                            mask = torch.ones(bs, dtype=torch.bool, device=self.dist.device)
                            self.compiler.mark_dynamic(beams, mask)
                        self._unit(kind)(*args, "greedy", d, ret, beams, mask).cpu()
        logger.info("engine warm-up (%s, buckets %s) took %.1fs", self.compiler.mode, sizes, time.perf_counter() - t0)
