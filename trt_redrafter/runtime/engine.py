"""The torch engine: load an engine directory, admit requests into batch slots, run batched steps.

`Engine.step(seqs)` runs one step for every given request:
    prompt phase   `DecodeStep.prefill` (eager; a request's prompt runs once), then the first draft
    decoding       one launch for all of them, as the speculation policy decides (policy.py): a tree step
                   (`DecodeStep.redrafter_step`: verify the first T nodes of every tree -> accept -> rewind -> draft ->
                   pack), each request keeping as many of the T as pay (its root only, for an AR request or one without
                   a fresh tree), or an AR step (`DecodeStep.ar_step`) when no tree pays
The decode steps run through `graphs.Unit`s (eager, inductor, CUDA graphs per batch bucket and tree width) and read
their state from the device (`SlotState`, the paged KV cache's block table); the host reads back one small tensor,
one row per request (step.RowLayout), and does the bookkeeping (stop conditions, statistics, the policy's
calibration, streaming events).

Each speculative request has a proposer (proposer.py; the engine's default, or its own), an object that says where
its trees come from:
    redrafter  the device drafter's beams, drafted and packed inside the step (no host work)
    ngram      N-gram drafts (ngram.py) composed on the host after the read-back
    mixed      the device drafter's beams, packed inside the step and read back with the emitted tokens; when the
               context has N-gram matches, the host puts them in place of the lowest-ranked beams
Trees composed on the host are packed at the start of the request's next step, so every step is still one launch
and one read-back.

Every rank runs the same steps on its shard; rank 0's decisions (the policy's, and the acceptance inside the step) are
broadcast, so ranks never drift apart. The engine knows nothing about text: token ids in, token ids out.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Hashable, Optional

import torch
from safetensors.torch import load_file

from .. import cpu as cpu_kernels
from ..config import DECODING_MODES, PROPOSERS, BuildConfig, RuntimeConfig, torch_dtype
from ..decoding import beam_search
from ..errors import UserError
from ..log import get_logger
from ..model.drafter import DrafterRank
from ..model.attention import cpu_tree_attention
from ..model.linear import resolve_linear
from ..model.llama import LlamaRank
from .distributed import Dist
from ..checkpoint.engine_config import EngineConfig, load_engine_config
from .graphs import Compiler, batch_buckets, bucket_for
from .kv_cache import PagedKVCache
from .ngram import NGRAMS_FILE, ModelNgrams, NgramProposer
from .policy import (AR_STEP, Candidate, CostModel, Policy, StepDecision, cost_cache_paths, fingerprint,
                     load_cost_model, save_cost_model, tree_buckets)
from .proposer import BeamDrafter, Draft, MixedProposer, Proposer, ReDrafterProposer
from .sequence import RequestSpec, Sequence, TreeNodes
from .state import SlotState, put_rows
from .step import DecodeStep, RowLayout, StepKernels
from .timing import PhaseTimer

logger = get_logger(__name__)
# TORCHINDUCTOR_CACHE_DIR at import, before an engine of this process points it at its own directory
USER_INDUCTOR_CACHE = os.environ.get("TORCHINDUCTOR_CACHE_DIR")


def _users_inductor_cache() -> Optional[str]:
    """TORCHINDUCTOR_CACHE_DIR if the user set it. Inductor writes its default (/tmp/torchinductor_<user>) into the
    environment on first use (cache_dir_utils.cache_dir), so in a process that imported dynamo or inductor before
    this module it holds that default, which is not the user's choice (read as one, every engine's kernels went to
    /tmp instead of beside the engine).
    Called when compiling: importing torch._inductor at import would import triton too early for TRITON_INTERPRET."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    value = USER_INDUCTOR_CACHE
    if value is None or os.path.abspath(value) == os.path.abspath(default_cache_dir()):
        return None
    return value


PHASES = ("verify", "accept", "rewind", "draft", "pack")
COST_CONTEXTS = (32, 1024)  # context lengths the cost model is measured at (the longer one capped by max_seq_len)
COST_REPEATS = (3, 9)  # timed calls per measured point (after one untimed): fewest, and most for the fastest ones
COST_POINT_S = 0.25  # ... so that each point takes about this long


@dataclass
class StepEvent:
    """What one step did for one request (streamed to clients)."""

    seq_id: Hashable  # the request's id (Request.request_id), or the engine's own count
    new_tokens: list[int]
    finished: bool


@dataclass
class StepTimes:
    """Wall time of decode steps by kind ("ar", "redrafter": a tree step; launch to read-back, host bookkeeping
    excluded), for cost ratios; and under "propose" the host's drafting between steps (N-gram proposer, mixed
    trees)."""

    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    steps: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    widths: dict[int, int] = field(default_factory=lambda: defaultdict(int))  # decode steps by verified width (0: AR)

    def add(self, kind: str, seconds: float) -> None:
        self.seconds[kind] += seconds
        self.steps[kind] += 1

    def mean_ms(self, kind: str) -> float:
        return 1e3 * self.seconds[kind] / self.steps[kind] if self.steps[kind] else 0.0

    def reset(self) -> None:
        self.seconds.clear()
        self.steps.clear()
        self.widths.clear()


class Engine:
    def __init__(self, engine_dir: str | Path, dist: Dist, runtime: RuntimeConfig | None = None,
                 proposer: Optional[Proposer] = None, warmup: bool = True, record_hidden: bool = False):
        self.engine_dir = Path(engine_dir)
        cfg = load_engine_config(self.engine_dir)
        if cfg.tp_size != dist.world_size:
            raise UserError(f"engine {self.engine_dir} was built for tp={cfg.tp_size} but {dist.world_size} "
                            f"rank(s) are running; launch with mpirun -n {cfg.tp_size}.")
        path = self.engine_dir / f"rank{dist.rank}.safetensors"
        if not path.is_file():
            raise UserError(f"engine {self.engine_dir} has no {path.name}; rebuild it with build-engine.")
        self._setup(cfg, load_file(str(path)), dist, runtime or RuntimeConfig(), proposer, warmup, record_hidden)

    @classmethod
    def from_tensors(cls, cfg: EngineConfig, tensors: dict[str, torch.Tensor], dist: Dist,
                     runtime: RuntimeConfig | None = None, proposer: Optional[Proposer] = None,
                     warmup: bool = True, record_hidden: bool = False) -> "Engine":
        """An engine over this rank's checkpoint tensors already in memory (benchmarks build random models in
        place); tensors already on the device in the compute dtype are used without a copy."""
        engine = cls.__new__(cls)
        engine.engine_dir = None
        engine._setup(cfg, tensors, dist, runtime or RuntimeConfig(), proposer, warmup, record_hidden)
        return engine

    def _setup(self, cfg: EngineConfig, tensors: dict[str, torch.Tensor], dist: Dist, runtime: RuntimeConfig,
               proposer: Optional[Proposer], warmup: bool, record_hidden: bool = False) -> None:
        """`record_hidden`: prompt and AR steps keep each request's last verified final-norm hidden state
        (`hidden_states`), for a drafter's distillation corpus."""
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
        self.model = LlamaRank(info.model, tensors, dist, self.dtype, per_seq, self.linear, info.quant)
        semantics = runtime.drafter_semantics or self.build.drafter_semantics
        self.drafter = None
        if info.drafter is not None:
            d_dtype = torch_dtype(runtime.drafter_dtype) if runtime.drafter_dtype else self._default_drafter_dtype()
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
        if record_hidden:
            self.state.record_hidden(m.hidden_size, self.dtype)
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
            select = functools.partial(beam_search.select_beams_topk, topk=cpu_kernels.topk)
        self.device_drafter = BeamDrafter(self.drafter, self.model.embed, rd.num_beams, rd.draft_len_per_beam,
                                          select=select) if self.drafter is not None else None
        table = self.engine_dir / NGRAMS_FILE if self.engine_dir is not None else None
        pc = cfg.proposer
        # what an N-gram request proposes (ngram.py): auto = the model's drafts too on a GPU, context matches on a CPU
        self.ngram_when = {"auto": "always" if dist.device.type == "cuda" else "matched",
                           "adaptive": "matched"}.get(pc.ngram_when, pc.ngram_when)
        self.ngram = NgramProposer(rd.num_beams, rd.draft_len_per_beam, pc,
                                   ModelNgrams.load(table, info.model.vocab_size) if table and table.is_file() else None,
                                   when=self.ngram_when)
        self.proposers: dict[str, Proposer] = {
            "redrafter": ReDrafterProposer(), "ngram": self.ngram,
            "mixed": MixedProposer(self.ngram, pc.ngram_beams, pc.mixed_min_match)}
        assert set(self.proposers) == set(PROPOSERS)
        self.override = proposer  # a test's oracle: it drafts every speculative request's trees
        if proposer is not None:
            assert (proposer.num_beams, proposer.draft_len) == (rd.num_beams, rd.draft_len_per_beam), \
                f"proposer drafts {proposer.num_beams}x{proposer.draft_len}, engine trees are " \
                f"{rd.num_beams}x{rd.draft_len_per_beam}"
        self.steps = DecodeStep(self.model, self.device_drafter, self.cache, self.state, dist, kernels)
        self.compiler = Compiler(runtime.compile, dist.device, dist.world_size)
        if "inductor" in self.compiler.mode:
            self._keep_inductor_cache()
        self.buckets = batch_buckets(self.build.max_batch_size)
        self.widths = tree_buckets(rd.max_tree_tokens)
        self._units: dict[tuple, object] = {}
        self.timer = PhaseTimer(dist.device, enabled=runtime.profile_phases)
        self.step_times = StepTimes()
        self._ids = itertools.count()
        self.policy = Policy(runtime.speculate, rd.max_tree_tokens)
        self.outcomes: Optional[list[tuple[str, int, int, bool]]] = None  # a list: record verified nodes (tools)
        if warmup and self.compiler.mode != "off":
            self.warmup()
        if self.policy.mode == "auto":
            self.policy._costs = self._cost_model()

    def _default_drafter_dtype(self) -> torch.dtype:
        """The drafter's dtype when none is asked for: bfloat16 for a float32 engine on a CPU whose kernels compute
        it natively (AVX512-BF16: half the bytes per drafted token; the drafter only proposes, so output is the
        same), else the model's."""
        if self.dist.device.type == "cpu" and self.dtype == torch.float32 and self.linear == "avx512" and \
                cpu_kernels.available(torch.bfloat16):
            return torch.bfloat16
        return self.dtype

    def _keep_inductor_cache(self) -> None:
        """Inductor's compiled kernels go beside the engine (`.cache/inductor`), so that the next process that loads
        it reuses them instead of compiling for minutes again; or where TORCHINDUCTOR_CACHE_DIR says; or, if the
        engine directory cannot be written, inductor's default under /tmp. Under TP each rank has its own
        subdirectory, as the ranks compile the same graphs at the same moment. (The TP=2 compiled test's lost ranks,
        once blamed on a shared directory, came from collectives traced into the graphs: model/tp.py.)"""
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        user = _users_inductor_cache()
        where = [Path(user)] if user else []
        if not where and self.engine_dir is not None:
            where.append(self.engine_dir / ".cache" / "inductor")
        where.append(Path(default_cache_dir()))
        for base in where:
            d = base / f"rank{self.dist.rank}" if self.dist.world_size > 1 else base
            try:
                d.mkdir(parents=True, exist_ok=True)
            except OSError:
                continue
            if os.access(d, os.W_OK):
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(d)
                return

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
    def proposer_of(self, seq: Sequence) -> Proposer:
        """The proposer that fills `seq`'s trees (a test's oracle, when the engine was given one)."""
        return self.override or self.proposers[seq.proposer]

    def new_sequence(self, spec: RequestSpec, seq_id: Hashable | None = None) -> Sequence:
        """Validate a request against the engine's limits and make its state. The spec's `proposer` (redrafter,
        ngram, mixed) overrides the engine's default for this request. `seq_id`: the request's own id (the
        scheduler passes Request.request_id, so one id names a request everywhere); by default the engine counts
        from 0. Negative integers are the engine's own (throw-away sequences of the cost model)."""
        if spec.mode not in DECODING_MODES:
            raise UserError(f"mode must be one of {', '.join(DECODING_MODES)}, got {spec.mode!r}.")
        name = spec.proposer or self.cfg.proposer.proposer
        if name not in self.proposers:
            raise UserError(f"proposer must be one of {', '.join(PROPOSERS)}, got {name!r}.")
        prop = self.proposers[name]
        if prop.on_device and self.drafter is None:
            raise UserError(f"proposer {name!r} needs a drafter, and this engine was built without one; use "
                            f"proposer 'ngram' (or rebuild with --drafter DIR).")
        if spec.mode == "redrafter" and not prop.drafter_probabilities and spec.params.resolved_acceptance == "apple":
            raise UserError(f"acceptance 'apple' weighs each draft by the drafter's probabilities, which "
                            f"{name!r} drafts do not have; use acceptance 'exact' (distribution-exact).")
        self.build.check_request(spec.prompt, spec.params.max_tokens, self.vocab_size)
        sid = next(self._ids) if seq_id is None else seq_id
        if self.cache.has(sid):  # two live sequences under one id would share KV blocks
            raise ValueError(f"sequence id {sid!r} already holds KV blocks on this engine; release it first")
        spec = dataclasses.replace(spec, prompt=list(spec.prompt),
                                   stop_sequences=tuple(tuple(q) for q in spec.stop_sequences if q))
        return Sequence(sid, spec, self.build.max_seq_len, proposer=name)

    def hidden_states(self, seqs: list[Sequence]) -> torch.Tensor:
        """[len(seqs), H] float32 on the CPU: the final-norm hidden state of the token each request's last step
        verified (its last prompt token after the prompt step, its true token after an AR step), the state whose
        logits chose the token that step emitted. Needs `record_hidden`; not written by tree steps."""
        if self.state.hidden is None:
            raise RuntimeError("this engine was made without record_hidden=True")
        idx = torch.tensor([s.slot for s in seqs], dtype=torch.long, device=self.state.hidden.device)
        return self.state.hidden[idx].float().cpu()

    def release(self, seq: Sequence) -> None:
        """Give back `seq`'s KV blocks and batch slot."""
        self.cache.free(seq.seq_id)
        seq.pending = seq.tree = None
        seq.tree_fresh = False
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
        if seq.speculative:
            return seq.ctx_len + self.redrafter.max_tree_tokens  # the padded tree is written whole
        return seq.ctx_len + 1  # a tree step writes its other positions to the cache's scratch block (kv_cache.py)

    # ---- the step --------------------------------------------------------------------------------------------
    def decide(self, seqs: list[Sequence]) -> StepDecision:
        """The policy's step for these requests (all past their prompt); the scheduler calls it on rank 0 and
        broadcasts the decision with the step plan."""
        decode = [s for s in seqs if not s.in_prompt_phase]
        if not decode:
            return AR_STEP
        cands = []
        for s in decode:
            spec = s.speculative
            cands.append(Candidate(
                s.seq_id, spec, s.tree.scores if spec and s.tree else None,
                self.policy.calibration(s.proposer, s.sampling.greedy) if spec else None,
                fresh=s.tree_fresh, whole_tree=s.apple, context=s.ctx_len))
        return self.policy.decide(cands, self._drafts_on_device(decode))

    @torch.inference_mode()
    def step(self, seqs: list[Sequence], decision: Optional[StepDecision] = None) -> list[StepEvent]:
        """One step for every given request, as `decision` says (default: this rank's policy decides; under TP every
        rank is given rank 0's)."""
        assert seqs and all(not s.finished for s in seqs), [s.seq_id for s in seqs]
        for s in seqs:
            self.cache.reserve(s.seq_id, self.tokens_needed(s))
            if s.slot < 0:
                assert self._free_slots, "more admitted requests than batch slots"
                s.slot = self._free_slots.pop()
                self.cache.bind(s.seq_id, s.slot)
                self.state.set_params([s.slot], [s.sampling], [s.apple])
        self.cache.sync()
        prompt = [s for s in seqs if s.in_prompt_phase]
        decode = [s for s in seqs if not s.in_prompt_phase]
        emitted: dict[int, list[int]] = {}
        compose: dict[Hashable, Optional[Draft]] = {}  # seq_id -> the device's draft (mixed) or None: next tree on host
        if decode:
            decision = decision if decision is not None else self.decide(decode)
            self._run_decode(decode, decision, emitted, compose)
        if prompt:
            for s, tok in zip(prompt, self._prefill(prompt, compose)):
                emitted[s.seq_id] = [tok]

        events = []
        for s in seqs:
            toks = emitted[s.seq_id]
            was_prompt = s.in_prompt_phase
            if was_prompt:
                s.prefilled, s.ctx_len = True, len(s.prompt) + len(s.output)
            else:
                s.ctx_len += len(toks)
            appended = s.append(toks)
            now = time.perf_counter()
            if was_prompt:
                s.stats.first_token_time = now
            else:
                s.stats.steps += 1
                s.stats.generated_in_steps += len(appended)
            events.append(StepEvent(s.seq_id, appended, s.finished))
        self._compose_on_host([s for s in seqs if s.seq_id in compose and not s.finished], compose)
        for cal in self.policy.calibrations.values():
            cal.decay()
        return events

    def _run_decode(self, group: list[Sequence], decision: StepDecision, emitted: dict[int, list[int]],
                    compose: dict[Hashable, Optional[Draft]]) -> None:
        """Launch one decode step for `group`, read it back, and record what it did for each request."""
        t0 = time.perf_counter()
        out, layout = self._launch(decision, group)
        rows = out.cpu().tolist()  # the step's one host sync
        kind = "redrafter" if decision.is_tree else "ar"
        took = time.perf_counter() - t0
        self.step_times.add(kind, took)
        self.policy.observe_step(decision, len(group), sum(s.ctx_len for s in group) / len(group), 1e3 * took)
        self.step_times.widths[decision.width] += 1
        nb = self.redrafter.num_beams
        for s, row in zip(group, rows):
            spec = s.speculative
            prop = self.proposer_of(s) if spec else None
            verified = s.tree if s.tree_fresh else None
            s.tree_fresh, s.pending = False, None  # the tree is the last one it had, until a new one is drafted
            if layout is None:  # AR step: [token | 1 | 0]
                emitted[s.seq_id] = row[:1]
                if spec and prop.on_host and decision.compose:
                    compose[s.seq_id] = None
                continue
            r = layout.parse(row)
            emitted[s.seq_id] = r.tokens
            kept = decision.keep.get(s.seq_id, 1)
            if spec and kept > 1 and verified is not None:
                self._record(s, verified, kept, r.path)
            if not spec:
                continue
            if r.scores and prop.on_device:
                s.tree, s.tree_fresh = TreeNodes(r.scores, r.depths), True
            if prop.on_host:
                compose[s.seq_id] = Draft.of_flat(r.beams, r.beam_scores, nb) if r.beams else None

    def _record(self, s: Sequence, verified: TreeNodes, kept: int, path: list[int]) -> None:
        """Statistics and the policy's calibration from one verified tree: its first `kept` nodes were verified, the
        ones at tree indices path[1:] accepted."""
        n = min(kept, len(verified))
        s.stats.accepted_draft_tokens += len(path) - 1
        s.stats.draft_tokens += max(verified.depths[:n])
        self.policy.calibration(s.proposer, s.sampling.greedy).observe(
            verified.scores[1:n], [verified.scores[i] for i in path[1:]])
        if self.outcomes is not None:  # every verified node: (proposer, score, depth, accepted)
            accepted = set(path[1:])
            self.outcomes += [(s.proposer, verified.scores[i], verified.depths[i], i in accepted) for i in range(1, n)]

    # ---- trees composed on the host --------------------------------------------------------------------------
    def _drafts_on_device(self, seqs) -> bool:
        """Whether the device drafter runs for these requests (one of them is speculative with an on-device
        proposer)."""
        return self.override is None and self.drafter is not None and any(
            s.speculative and self.proposers[s.proposer].on_device for s in seqs)

    def _compose_on_host(self, seqs: list[Sequence], device: dict[Hashable, Optional[Draft]]) -> None:
        """The next tree of each of `seqs` (drafts, packed by its next tree step): its proposer's `compose`, from the
        device's draft where the proposer wants it; None keeps the tree the step packed (or leaves none)."""
        if not seqs:
            return
        t0 = time.perf_counter()
        for s in seqs:
            draft = self.proposer_of(s).compose(s, device.get(s.seq_id))
            if draft is not None:
                s.pending, s.tree, s.tree_fresh = draft, TreeNodes(*draft.nodes()), True
        took = time.perf_counter() - t0
        self.step_times.add("propose", took)
        self.policy.observe_host(1e3 * took / len(seqs))

    def _rule(self, group: list[Sequence]) -> str:
        """The batch's acceptance variant: apple (some speculative request asks for it), greedy (every request is
        greedy) or sample (counter-based draws per node; greedy rows take their argmax through them)."""
        if any(s.apple for s in group):
            return "apple"
        return "greedy" if all(s.sampling.greedy for s in group) else "sample"

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

    def _launch(self, decision: StepDecision, group: list[Sequence]) -> tuple[torch.Tensor, Optional[RowLayout]]:
        """Start one decode step for `group` -> (its output rows on the device, maybe still running; their layout,
        None for an AR step)."""
        rule = self._rule(group)
        slots = [s.slot for s in group]
        if not decision.is_tree:
            args = self._step_inputs(slots, 1, max(s.ctx_len for s in group) + 1)
            return self._unit("ar")(*args[:2], rule)[:len(group)], None
        if rule == "apple":
            self.state.ensure_draft_logp(self.vocab_size)
        keep = [decision.keep.get(s.seq_id, 1) for s in group]
        T = self._verify_width(decision.width, max(keep))
        args = self._step_inputs(slots, T, max(s.ctx_len for s in group) + T, keep)
        draft = decision.draft and self._drafts_on_device(group)
        ret = draft and any(s.speculative and self.proposer_of(s).wants_device_beams for s in group)
        variant = (rule, draft, ret, *self._host_inputs(group, args[0].shape[0]))
        layout = RowLayout(self.redrafter.beam_length, self.redrafter.max_tree_tokens, draft,
                           self.redrafter.num_beams * self.redrafter.beam_length if ret else 0)
        if self.timer.enabled:  # each phase its own unit, timed
            out = self.steps.redrafter_step(*args, *variant, run=self._timed_phase)
            self.timer.end_step()
        else:
            out = self._unit("redrafter")(*args, *variant)
        return out[:len(group)], layout

    def _verify_width(self, width: int, kept: int) -> int:
        """Tree nodes a step verifies: the bucket's width under CUDA graphs (captured shapes), else just the nodes
        some request keeps, at least 2: inductor compiles one graph for every width >= 2 (a width of 1 would
        specialize, and cost a compilation of its own for what one more node costs)."""
        return width if self.compiler.uses_graphs else max(2, kept)

    def _host_inputs(self, group: list[Sequence], n: int
                     ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(host_beams [n, nb, bl], host_scores [n, nb, dl], host_mask [n]) of the group's trees composed on the host
        (None if none); taken: the step packs them."""
        pending = [s.pending for s in group]
        if all(p is None for p in pending):
            return None, None, None
        nb, bl = self.redrafter.num_beams, self.redrafter.beam_length
        empty_rows, empty_scores = [[0] * bl] * nb, [[0] * (bl - 1)] * nb
        rows = [p.rows if p is not None else empty_rows for p in pending] + [empty_rows] * (n - len(group))
        scores = [p.scores if p is not None else empty_scores for p in pending] + [empty_scores] * (n - len(group))
        mask = [p is not None for p in pending] + [False] * (n - len(group))
        for s in group:
            s.pending = None
        dev = self.dist.device
        beams = torch.tensor(rows, dtype=torch.long).to(dev)
        scores_t, mask_t = torch.tensor(scores, dtype=torch.long).to(dev), torch.tensor(mask).to(dev)
        self.compiler.mark_dynamic(beams, scores_t, mask_t)
        return beams, scores_t, mask_t

    def _step_inputs(self, slots: list[int], T: int, longest: int, keep: Optional[list[int]] = None
                     ) -> tuple[torch.Tensor, ...]:
        """(slots, key_blocks, tree_width, keep) of a decode step: slots padded to a batch bucket under CUDA graphs
        (padding rows keep their root), and every varying size marked dynamic for inductor."""
        pad = bucket_for(len(slots), self.buckets) - len(slots) if self.compiler.uses_graphs else 0
        keep = (keep or [1] * len(slots)) + [1] * pad
        dev = self.dist.device
        args = (torch.tensor(slots + [self.state.padding_slot] * pad, dtype=torch.long, device=dev),
                self._key_blocks(longest), torch.arange(T, device=dev), torch.tensor(keep, dtype=torch.long, device=dev))
        # key_blocks varies only where the attention reads every block it is given (`_key_blocks`)
        self.compiler.mark_dynamic(*(args if self._trims_key_blocks() else (args[0], args[2], args[3])))
        return args

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

    def _prefill(self, seqs: list[Sequence], compose: dict[Hashable, Optional[Draft]]) -> list[int]:
        """Prompt step (eager) for newly admitted (or preempted) requests -> their first true tokens; their first trees
        drafted on the device (their nodes in `seq.tree`), and the rows whose first tree the host composes put into
        `compose` (with the device's draft, where the proposer wants it)."""
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
        rd = [i for i, s in enumerate(seqs) if self._drafts_on_device([s])]
        P = self.redrafter.max_tree_tokens
        if rd:
            if rule == "apple":
                self.state.ensure_draft_logp(self.vocab_size)
            idx = torch.tensor(rd, device=dev)
            packed = self.steps.draft_from_prompt(slots[idx], h[idx], rule == "apple").tolist()
            want = [i for i in rd if self.proposer_of(seqs[i]).wants_device_beams]
            beams = {}
            if want:  # mixed: the host composes with the device's beams, read once
                w = slots[torch.tensor(want, device=dev)]
                beams = dict(zip(want, zip(self.state.beams[w].flatten(1).tolist(),
                                           self.state.scores[w].flatten(1).tolist())))
            for i, row in zip(rd, packed):
                n = row[0]
                seqs[i].tree, seqs[i].tree_fresh = TreeNodes(row[1:1 + n], row[1 + P:1 + P + n]), True
                if i in beams:
                    compose[seqs[i].seq_id] = Draft.of_flat(*beams[i], self.redrafter.num_beams)
        for s in seqs:
            if s.speculative and self.proposer_of(s).on_host and s.seq_id not in compose:
                compose[s.seq_id] = None
        return self.state.true_tok[slots].tolist()

    # ---- warm-up and the cost model ---------------------------------------------------------------------------
    def warmup(self, trees: bool = True) -> None:
        """Compile / capture the greedy decode steps of the engine's default proposer before the first request
        (padding-slot batches only; other proposers' variants compile when first asked for): the AR step and (`trees`)
        the tree step at every tree width the policy may choose (CUDA graphs: per batch bucket)."""
        from tqdm import tqdm

        t0 = time.perf_counter()
        sizes = self.buckets if self.compiler.uses_graphs else sorted({1, min(2, self.build.max_batch_size)})
        prop = self.override or self.proposers[self.cfg.proposer.proposer]
        draft = self.override is None and self.drafter is not None and prop.on_device
        ret = draft and prop.wants_device_beams
        # (draft, return beams, host-composed trees in): see `_launch`; a mixed tree is host-composed on some steps
        variants = [(draft, ret, False)] if not prop.on_host else \
            [(draft, ret, True)] + ([(draft, ret, False)] if prop.on_device else [])
        widths = self.widths if self.compiler.uses_graphs else [self._verify_width(0, self.redrafter.max_tree_tokens)]
        nb, bl = self.redrafter.num_beams, self.redrafter.beam_length
        work = [(bs, None) for bs in sorted(sizes, reverse=True)] + \
               [(bs, (T, v)) for bs in sorted(sizes, reverse=True) for T in widths for v in variants if trees]
        dev = self.dist.device
        with torch.inference_mode():  # largest batches first: later captures reuse their pool memory
            for bs, tree_variant in tqdm(work, desc=f"compiling decode steps ({self.compiler.mode})", unit="graph",
                                         disable=not self.dist.is_driver or None, leave=False):
                if tree_variant is None:
                    args = self._step_inputs([self.state.padding_slot] * bs, 1, 1)
                    self._unit("ar")(*args[:2], "greedy").cpu()
                    continue
                T, (d, r, host) = tree_variant
                args = self._step_inputs([self.state.padding_slot] * bs, T, T)
                beams = scores = mask = None
                if host:
                    beams = torch.zeros(bs, nb, bl, dtype=torch.long, device=dev)
                    scores = torch.zeros(bs, nb, bl - 1, dtype=torch.long, device=dev)
                    mask = torch.ones(bs, dtype=torch.bool, device=dev)
                    self.compiler.mark_dynamic(beams, scores, mask)
                self._unit("redrafter")(*args, "greedy", d, r, beams, scores, mask).cpu()
        logger.info("engine warm-up (%s, buckets %s, tree widths %s) took %.1fs", self.compiler.mode, sizes,
                    widths if trees else "none: AR steps only", time.perf_counter() - t0)

    def _cost_model(self) -> CostModel:
        """The policy's cost model: from the cache beside the engine (or the user's cache) when one was measured for
        this machine and these settings, else measured now (every rank takes part: the steps are collective)."""
        key = fingerprint(device=self.dist.device, engine=self._identity(), dtype=str(self.dtype),
                          drafter_dtype=str(self.drafter.dtype) if self.drafter is not None else None,
                          kernels=self.kernels, linear=self.linear, compile=self.compiler.mode,
                          threads=torch.get_num_threads(), tp=self.dist.world_size)
        paths = cost_cache_paths(self.engine_dir)
        model = load_cost_model(paths, key) if self.dist.is_driver else None
        if self.dist.broadcast_object(model is not None):
            return model
        model = self.measure_costs()
        model.key = key
        if self.dist.is_driver:
            where = save_cost_model(paths, model)
            logger.info("step cost model measured and saved to %s", where or "(nowhere writable)")
        return model

    def _identity(self) -> str:
        """What identifies the engine's step costs: its configuration (shapes, limits, tree)."""
        return json.dumps({"build": self.build.to_dict(), "tree": self.redrafter.to_dict(),
                           "model": self.cfg.checkpoint.model.to_dict(),
                           "drafter": self.cfg.checkpoint.drafter.to_dict() if self.cfg.checkpoint.drafter else None},
                          sort_keys=True)

    @torch.inference_mode()
    def measure_costs(self) -> CostModel:
        """Time the decode steps on this machine: an AR step, and a tree step (verifying T nodes, drafting the next
        trees) at every tree width, for every batch bucket, at two context lengths (COST_CONTEXTS). Runs on free batch
        slots with throw-away KV; a width that could not pay even if every node were accepted (its step costs more
        than 1 + dl AR steps) ends the widths of that batch size (the rest are extrapolated, proportionally). The
        calls of one point are timed in interleaved rounds, so that the machine's slow phases do not bias the
        ratios between them. Under TP every rank takes part (the steps are collective) and rank 0's timings decide
        how many steps run."""
        from tqdm import tqdm

        t0 = time.perf_counter()
        rd = self.redrafter
        P, dl = rd.max_tree_tokens, rd.draft_len_per_beam
        hi = max(COST_CONTEXTS[0] + 1, min(COST_CONTEXTS[1], self.build.max_seq_len - P - 1))
        contexts = [min(COST_CONTEXTS[0], hi - 1), hi]
        batches = [b for b in self.buckets if b <= len(self._free_slots)]
        free = sorted(self._free_slots)[:batches[-1]]
        ids = [-1 - i for i in range(len(free))]  # throw-away sequences (real ones count from 0)
        for sid, slot in zip(ids, free):
            self.cache.reserve(sid, hi + P)
            self.cache.bind(sid, slot)
        self.cache.sync()
        draft = self.drafter is not None and self.override is None and \
            self.proposers[self.cfg.proposer.proposer].on_device
        dev = self.dist.device

        def once(call, slots: torch.Tensor, ctx: int) -> float:
            put_rows(self.state.ctx_len, slots, torch.full_like(slots, ctx))
            t = time.perf_counter()
            call().cpu()
            return time.perf_counter() - t

        def timed(calls: list, slots: torch.Tensor, ctx: int) -> list[float]:
            """Median ms of each call, timed in rounds of one call each: a slow phase of the machine (they last
            seconds here) then slows every call of a point alike, and the ratios the policy decides by stay put.
            One untimed round first; rank 0's timings set the number of rounds (every step is collective)."""
            times: list[list[float]] = [[] for _ in calls]
            rounds, r = COST_REPEATS[0], 0
            while r < rounds + 1:
                for i, call in enumerate(calls):
                    times[i].append(once(call, slots, ctx))
                if r == 1:
                    per_round = sum(t[1] for t in times)
                    rounds = self.dist.broadcast_object(
                        max(COST_REPEATS[0], min(COST_REPEATS[1], int(COST_POINT_S * len(calls) / per_round))))
                r += 1
            return [1e3 * statistics.median(t[1:]) for t in times]

        # untimed first: the first steps after loading fault the weights in and build lazily made things
        warm = self._step_inputs(free[:1], self._verify_width(P, P), contexts[0] + P, [P])
        for _ in range(3):
            self._unit("ar")(*warm[:2], "greedy").cpu()
            self._unit("redrafter")(*warm, "greedy", draft, False, None, None, None).cpu()

        ar = [[0.0] * len(batches) for _ in contexts]
        tree = [[[0.0] * len(self.widths) for _ in batches] for _ in contexts]
        grid = [(c, b) for c in range(len(contexts)) for b in range(len(batches))]
        for c, b in tqdm(grid, desc="measuring step costs", unit="point", disable=not self.dist.is_driver or None,
                         leave=False):
            ctx, bs = contexts[c], batches[b]
            slots = [free[i] for i in range(bs)]
            a = self._step_inputs(slots, 1, ctx + 1)
            calls = [lambda a=a: self._unit("ar")(*a[:2], "greedy")]

            def probe(call) -> float:  # the second of two calls (the first may still build things)
                return [once(call, a[0], ctx) for _ in range(2)][1]

            # widths in order, probed, until one could not pay even if all its nodes were accepted; the rounds below
            # time the AR step and the widths up to that one
            ar_probe = probe(calls[0])
            for T in self.widths:
                t = self._step_inputs(slots, self._verify_width(T, T), ctx + T, [T] * bs)
                calls.append(lambda t=t: self._unit("redrafter")(*t, "greedy", draft, False, None, None, None))
                if self.dist.broadcast_object(probe(calls[-1]) > (1 + dl) * ar_probe):
                    break
            ms = timed(calls, a[0], ctx)
            ar[c][b] = ms[0]
            n = len(ms) - 1
            for w, T in enumerate(self.widths):  # the widths past the cut-off extrapolated, proportionally
                tree[c][b][w] = ms[1 + w] if w < n else ms[n] * T / self.widths[n - 1]
        for sid in ids:
            self.cache.free(sid)
        put_rows(self.state.ctx_len, torch.tensor(free, device=dev), torch.zeros(len(free), dtype=torch.long,
                                                                                 device=dev))
        model = CostModel(batches, list(self.widths), contexts, ar, tree)
        logger.info("step costs measured in %.1fs (%d batch sizes x %d tree widths x %d contexts)",
                    time.perf_counter() - t0, len(batches), len(self.widths), len(contexts))
        return model
