"""The torch engine: load an engine directory, admit requests into batch slots, run batched steps.

`Engine.step(seqs)` runs one step for every given request, grouped by what they need:
    prompt phase   `DecodeStep.prefill` (eager; a request's prompt runs once), then the first draft
    ReDrafter      `DecodeStep.redrafter_step`: verify -> accept -> rewind -> draft -> pack (step.py)
    AR             `DecodeStep.ar_step`
The decode steps run through `graphs.Unit`s (eager, inductor, CUDA graphs per batch bucket) and read their state
from the device (`SlotState`, the paged KV cache's block table); the host reads back one small tensor per group,
the emitted tokens, and does the bookkeeping (stop conditions, statistics, streaming events). With a host
proposer the next trees are drafted after that read-back.

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
from typing import Optional, Union

import torch
from safetensors.torch import load_file

from ..config import DECODING_MODES, BuildConfig, RuntimeConfig, SamplingConfig, torch_dtype
from ..errors import UserError
from ..log import get_logger
from ..model.drafter import DrafterRank
from ..model.llama import LlamaRank
from .distributed import Dist
from .engine_config import EngineConfig, load_engine_config
from .graphs import Compiler, batch_buckets, bucket_for
from .kv_cache import PagedKVCache
from .proposer import DeviceProposer, HostProposer, ReDrafterProposer
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
    """Wall time of decode steps by kind (launch to read-back, host bookkeeping excluded), for cost ratios."""

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
        self.redrafter = rd = info.redrafter
        self.build: BuildConfig = cfg.build
        self.dtype = torch_dtype(runtime.dtype or self.build.dtype or info.model.dtype)
        per_seq = self.build.max_seq_len + rd.max_tree_tokens  # a full request plus one draft tree
        self.model = LlamaRank(info.model, tensors, dist, self.dtype, per_seq)
        self.drafter = DrafterRank(info.drafter, tensors, dist, self.dtype, runtime.drafter_semantics)
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
        self.host_proposer = proposer
        self.proposer: Union[DeviceProposer, HostProposer] = proposer or ReDrafterProposer(
            self.drafter, self.model.embed, rd.num_beams, rd.draft_len_per_beam, select=select)
        assert (self.proposer.num_beams, self.proposer.draft_len) == (rd.num_beams, rd.draft_len_per_beam), \
            f"proposer drafts {self.proposer.num_beams}x{self.proposer.draft_len}, engine trees are " \
            f"{rd.num_beams}x{rd.draft_len_per_beam}"
        self.steps = DecodeStep(self.model, None if proposer else self.proposer, self.cache, self.state, dist,
                                kernels)
        self.compiler = Compiler(runtime.compile, dist.device, dist.world_size)
        self.buckets = batch_buckets(self.build.max_batch_size)
        self._units: dict[tuple, object] = {}
        self.timer = PhaseTimer(dist.device, enabled=runtime.profile_phases)
        self.step_times = StepTimes()
        self._ids = itertools.count()
        if warmup and self.compiler.mode != "off":
            self.warmup()

    def _resolve_kernels(self) -> str:
        want = self.runtime.kernels
        if self.dist.device.type != "cuda":
            if want == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
                raise UserError("--kernels triton needs a CUDA device (on the CPU the kernels run only under "
                                "TRITON_INTERPRET=1, in tests); use --kernels auto or torch.")
            if want != "triton":
                return "torch"
        if want == "torch":
            return "torch"
        try:
            from .. import plugins  # noqa: F401
        except ImportError as e:
            if want == "triton":
                raise UserError(f"--kernels triton but the Triton kernels cannot load ({e}); pip install triton.") from e
            logger.warning("Triton kernels unavailable (%s); using the PyTorch path", e)
            return "torch"
        return "triton"

    # ---- requests --------------------------------------------------------------------------------------------
    def new_sequence(self, prompt: list[int], params: SamplingConfig, mode: str = "redrafter",
                     stop_ids: tuple[int, ...] = (), seq_id: int | None = None,
                     stop_sequences: tuple[tuple[int, ...], ...] = ()) -> Sequence:
        """Validate a request against the engine's limits and make its state."""
        if mode not in DECODING_MODES:
            raise UserError(f"mode must be one of {', '.join(DECODING_MODES)}, got {mode!r}.")
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
                        stop_sequences=tuple(tuple(q) for q in stop_sequences if q))

    def release(self, seq: Sequence) -> None:
        """Give back `seq`'s KV blocks and batch slot."""
        self.cache.free(seq.seq_id)
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
    def step(self, seqs: list[Sequence]) -> list[StepEvent]:
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
        groups = [(kind, [s for s in seqs if not s.in_prompt_phase and s.mode == kind]) for kind in DECODING_MODES]
        launched = [(kind, g, self._launch(kind, g)) for kind, g in groups if g]  # all groups, then read back
        emitted: dict[int, list[int]] = {}
        for kind, group, (out, t0) in launched:
            rows = out.cpu().tolist()  # the step's one host sync
            self.step_times.add(kind, time.perf_counter() - t0)
            for s, row in zip(group, rows):  # [tokens (bl) | count | next tree length]
                emitted[s.seq_id] = row[:row[-2]]
                s.tree_len = row[-1]
        if prompt:
            for s, (tok, tree_len) in zip(prompt, self._prefill(prompt)):
                emitted[s.seq_id] = [tok]
                s.tree_len = tree_len

        events, host_draft = [], []
        dl = self.redrafter.draft_len_per_beam
        for s in seqs:
            toks = emitted[s.seq_id]
            was_prompt = s.in_prompt_phase
            if was_prompt:
                s.prefilled, s.ctx_len = True, len(s.prompt) + len(s.output)
            else:
                s.ctx_len += len(toks)
                if s.mode == "redrafter":
                    s.stats.accepted_draft_tokens += len(toks) - 1
                    s.stats.draft_tokens += dl
            appended = s.append(toks)
            now = time.perf_counter()
            if was_prompt:
                s.stats.first_token_time = now
            else:
                s.stats.steps += 1
                s.stats.generated_in_steps += len(appended)
            events.append(StepEvent(s.seq_id, appended, s.finished))
            if self.host_proposer is not None and not s.finished and s.mode == "redrafter":
                host_draft.append(s)
        if host_draft:
            self._draft_on_host(host_draft)
        return events

    def _rule(self, group: list[Sequence]) -> str:
        rules = {s.sampling.resolved_acceptance for s in group}
        if "apple" in rules and group[0].mode == "redrafter":
            return "apple"
        return "greedy" if rules == {"greedy"} else "sample"

    def _key_blocks(self, longest: int) -> torch.Tensor:
        """[nblk]: how many KV blocks per request the torch attention reads. All of them under CUDA graphs (static
        shapes) or with the Triton kernel (it stops at each request's length); else enough for `longest`
        positions, at least 2 so that inductor's one dynamic graph covers every length (size 1 would specialize)."""
        n = self.cache.max_blocks_per_seq
        if not (self.compiler.uses_graphs or self.kernels == "triton"):
            n = min(max(2, -(-longest // self.cache.block_size)), n)
        return torch.arange(n, device=self.dist.device)

    def _launch(self, kind: str, group: list[Sequence]) -> tuple[torch.Tensor, float]:
        """Start one decode step for `group` -> (emitted [bs, bl+1] on the device, maybe still running; start time)."""
        t0 = time.perf_counter()
        rule = self._rule(group)
        if rule == "apple":
            self.state.ensure_draft_logp(self.vocab_size)
        draft = self.host_proposer is None
        T = self._tree_width(group) if kind == "redrafter" else 1
        args = self._step_inputs([s.slot for s in group], T, max(s.ctx_len for s in group) + T)
        if self.timer.enabled and kind == "redrafter":  # each phase its own unit, timed
            out = self.steps.redrafter_step(*args, rule, draft, run=self._timed_phase)
            self.timer.end_step()
        else:
            out = self._unit(kind)(*args, rule, draft)
        return out[:len(group)], t0

    def _step_inputs(self, slots: list[int], T: int, longest: int) -> tuple[torch.Tensor, ...]:
        """(slots, key_blocks, tree_width) of a decode step: slots padded to a batch bucket under CUDA graphs, and
        every varying size marked dynamic for inductor."""
        if self.compiler.uses_graphs:
            slots = slots + [self.state.padding_slot] * (bucket_for(len(slots), self.buckets) - len(slots))
        args = (torch.tensor(slots, dtype=torch.long, device=self.dist.device), self._key_blocks(longest),
                torch.arange(T, device=self.dist.device))
        self.compiler.mark_dynamic(*args)
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
        unit = self._units.get(name)
        if unit is None:  # drafting writes no state: its capture needs no padding-slot arguments
            unit = self._units[name] = self.compiler.unit(phase, name, None if name == "draft" else self._on_padding)
        with self.timer.phase(name):
            return unit(*args)

    def _on_padding(self, slots: torch.Tensor, *rest):
        """The same call on padding slots only (what a CUDA-graph capture may run for real)."""
        return (torch.full_like(slots, self.state.padding_slot), *rest)

    def _prefill(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """Prompt step (eager) for newly admitted (or preempted) requests -> (first true token, tree length)."""
        dev = self.dist.device
        texts = [s.prompt + s.output for s in seqs]
        lengths = torch.tensor([len(t) for t in texts], dtype=torch.long)
        ids = torch.zeros(len(texts), int(lengths.max()), dtype=torch.long)
        for i, t in enumerate(texts):
            ids[i, :len(t)] = torch.tensor(t)
        slots = torch.tensor([s.slot for s in seqs], dtype=torch.long, device=dev)
        rule = self._rule(seqs)
        h = self.steps.prefill(slots, ids.to(dev), lengths.to(dev), rule)
        rd = [i for i, s in enumerate(seqs) if s.mode == "redrafter"]
        tree_len = [0] * len(seqs)
        if rd and self.host_proposer is None:
            if rule == "apple":
                self.state.ensure_draft_logp(self.vocab_size)
            idx = torch.tensor(rd, device=dev)
            for i, n in zip(rd, self.steps.draft_from_prompt(slots[idx], h[idx], rule == "apple").tolist()):
                tree_len[i] = n
        return list(zip(self.state.true_tok[slots].tolist(), tree_len))

    def _draft_on_host(self, seqs: list[Sequence]) -> None:
        """Ask the host proposer for the next trees of `seqs` and pack them on the device."""
        beams = self.host_proposer.propose(seqs)
        rd = self.redrafter
        assert beams.shape == (len(seqs), rd.num_beams, rd.beam_length), \
            f"host proposer returned {tuple(beams.shape)}, expected {(len(seqs), rd.num_beams, rd.beam_length)}"
        dev = self.dist.device
        slots = torch.tensor([s.slot for s in seqs], dtype=torch.long, device=dev)
        for s, n in zip(seqs, self.steps.pack(slots, self.dist.broadcast(beams.to(dev)), None).tolist()):
            s.tree_len = n

    # ---- warm-up ------------------------------------------------------------------------------------------
    def warmup(self) -> None:
        """Compile / capture the greedy decode steps before the first request (padding-slot batches only)."""
        t0 = time.perf_counter()
        sizes = self.buckets if self.compiler.uses_graphs else sorted({1, min(2, self.build.max_batch_size)})
        draft = self.host_proposer is None
        with torch.inference_mode():
            for kind in DECODING_MODES:
                T = self.redrafter.max_tree_tokens if kind == "redrafter" else 1
                for bs in sorted(sizes, reverse=True):  # largest first: later captures reuse its pool memory
                    args = self._step_inputs([self.state.padding_slot] * bs, T, T)
                    self._unit(kind)(*args, "greedy", draft).cpu()
        logger.info("engine warm-up (%s, buckets %s) took %.1fs", self.compiler.mode, sizes, time.perf_counter() - t0)
