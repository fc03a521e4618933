"""The torch engine: load an engine directory, admit requests into batch slots, run batched steps.

`Engine.step(seqs)` runs one step for every given request:
    prompt phase   `DecodeStep.prefill` (eager; a request's prompt runs once), then the first draft
    decoding       one launch for all of them, as the speculation policy decides (policy.py): a tree step
                   (`DecodeStep.redrafter_step`: verify the first T nodes of every tree -> accept -> rewind -> draft ->
                   pack), each request keeping as many of the T as pay (its root only, for an AR request or one without
                   a fresh tree), or an AR step (`DecodeStep.ar_step`) when no tree pays
`launch.StepLauncher` runs the decode steps through `graphs.Unit`s (eager, inductor, CUDA graphs per batch bucket and
tree width); they read their state from the device (`SlotState`, the paged KV cache's block table), and the host
reads back one small tensor, one row per request (step.RowLayout), and does the bookkeeping (stop conditions,
statistics, the policy's calibration, streaming events).

Each speculative request has a proposer (proposer.py; the engine's default, or its own), which owns where its trees
come from: the device drafter, inside the step (ReDrafter), the host between steps (N-gram), or both (mixed: the
device's beams, N-gram matches in place of the lowest-ranked ones). Trees composed on the host are packed at the start
of the request's next step, so every step is still one launch and one read-back.

Every rank runs the same steps on its shard; rank 0's decisions (the policy's, and the acceptance inside the step) are
broadcast, so ranks never drift apart. The engine knows nothing about text: token ids in, token ids out.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import gc
import itertools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Hashable, Optional

import torch
from safetensors.torch import load_file

from ..config import DECODING_MODES, PROPOSERS, AcceptanceRule, BuildConfig, DecodingMode, RuntimeConfig, torch_dtype
from ..decoding import logprobs as token_logprobs
from ..decoding.logprobs import TokenLogprob
from ..errors import UserError
from ..log import get_logger
from ..model.linear import resolve_linear
from ..checkpoint.engine_config import EngineConfig, load_engine_config
from . import costs
from .distributed import Dist
from .drafter import BeamDrafter
from .grammar import Grammars
from .graphs import Compiler
from .launch import StepLauncher, draft_beam_options, draft_depth_options, variant_for, warmup_variants
from .loading import keep_inductor_cache, load_models, make_proposers, ngram_when, plug_kernels, resolve_kernels
from .policy import AR_STEP, Candidate, Policy, StepDecision
from .prompt import PromptPhase
from .proposer import HostCompose, Proposer, drafts_on_device, returns_device_beams
from .sequence import Draft, RequestSpec, Sequence, StepEvent, TreeNodes
from .slots import BatchSlots
from .step import SCORE_FLOOR, DecodeStep, RowLayout
from .timing import PhaseTimer, StepTimes

logger = get_logger(__name__)

# a pause between decode steps longer than this and than the last step is the scheduler waiting for work (no request
# to step), not the host's time per step (Policy.observe_between)
BETWEEN_STEPS_MAX_S = 0.005


def freeze_heap() -> None:
    """Put every object alive now (the libraries, the engine's modules, graphs and weights' wrappers: millions) out of
    the garbage collector's reach, for a process that loaded its engine and now serves or decodes. Each decode step
    makes a few hundred container objects, and every collection of the oldest generation they triggered walked all of
    those millions again: on models/small (0.2 ms steps) AR's ms/token fell 4.5% and ReDrafter's 8% with them frozen
    (the policy's decisions make more objects). vLLM and SGLang freeze after start-up too. Frozen objects are never
    collected: `thaw_heap` (or the end of `frozen_heap`'s block, or exit) gives them back, so that an engine torn down
    afterwards is collected as before."""
    global _THAW_AT_EXIT
    gc.collect()
    gc.freeze()
    if not _THAW_AT_EXIT:  # extension modules check at exit that their objects were freed
        atexit.register(thaw_heap)
        _THAW_AT_EXIT = True


def thaw_heap() -> None:
    """Undo `freeze_heap`: the frozen objects are the collector's again."""
    gc.unfreeze()


@contextlib.contextmanager
def frozen_heap():
    """`freeze_heap` for the block (a command's decoding, after its engine loaded), `thaw_heap` after it."""
    freeze_heap()
    try:
        yield
    finally:
        thaw_heap()


_THAW_AT_EXIT = False


@dataclass
class Emitted:
    """What a step produced for one request: its tokens, their log-probabilities (where it asked for them), and its
    next tree's host work (None: none)."""

    tokens: list[int]
    host: Optional[HostCompose] = None
    logprobs: Optional[list[TokenLogprob]] = None


class Engine:
    """One rank's engine over its checkpoint tensors (`Engine.load` reads them from an engine directory)."""

    def __init__(self, cfg: EngineConfig, tensors: dict[str, torch.Tensor], dist: Dist,
                 runtime: RuntimeConfig | None = None, proposer: Optional[Proposer] = None, warmup: bool = True,
                 record_hidden: bool = False, engine_dir: Optional[Path] = None, speculative: bool = True):
        """`tensors` already on the device in the compute dtype are used without a copy; `proposer`: a test's oracle
        that drafts every speculative request's trees; `record_hidden`: prompt and AR steps keep each request's last
        verified final-norm hidden state (`hidden_states`), for a drafter's distillation corpus; `speculative=False`:
        every request will be auto-regressive (`run --mode ar`), so no tree step is compiled and no step cost model
        measured (the policy's, tens of seconds on a fresh engine), and a speculative request is refused."""
        runtime = runtime or RuntimeConfig()
        self.cfg, self.runtime, self.dist, self.engine_dir = cfg, runtime, dist, engine_dir
        if runtime.threads:
            torch.set_num_threads(runtime.threads)
        self.tree = tree = cfg.tree  # the draft-tree shape (nb x dl) every tree step verifies
        self.build: BuildConfig = cfg.build
        m = cfg.checkpoint.model
        self.dtype = torch_dtype(runtime.dtype or self.build.dtype or m.dtype)
        self.vocab_size = m.vocab_size
        self.linear = resolve_linear(runtime.linear, dist.device, self.dtype,  # "torch" | "onednn" | "avx512"
                                     quantized=cfg.checkpoint.quant is not None)
        self.model, self.drafter, self.cache, self.state = load_models(cfg, tensors, dist, runtime, self.dtype,
                                                                       self.linear, record_hidden)
        del tensors
        self.slots = BatchSlots(self.cache, self.state, tree.max_tree_tokens)
        self.kernels = resolve_kernels(runtime.kernels, dist.device, self.dtype, self.model.D)
        self.compiler = Compiler(runtime.compile, dist.device, dist.world_size)
        step_kernels, select = plug_kernels(self.kernels, self.model, self.cache, self.compiler.mode)
        # with the CPU kernels, the whole beam search in one of them where it applies (runtime/drafter.py)
        self.device_drafter = BeamDrafter(
            self.drafter, self.model.embed, tree.num_beams, tree.draft_len_per_beam, select,
            embedding=self.model.embedding if self.kernels == "cpu" else None) if self.drafter is not None else None
        self.max_logprobs = min(runtime.max_logprobs, self.vocab_size)
        self.grammars = Grammars(engine_dir / "tokenizer" if engine_dir is not None else None, self.vocab_size,
                                 (tree.num_beams, tree.beam_length))
        self.steps = DecodeStep(self.model, self.device_drafter, self.cache, self.state, dist, step_kernels,
                                self.max_logprobs)
        self.ngram_when = ngram_when(cfg.proposer, dist.device)
        self.proposers = make_proposers(cfg.proposer, tree, self.device_drafter, self.ngram_when, engine_dir,
                                        self.vocab_size)
        self.ngram = self.proposers["ngram"]
        self.override = proposer  # a test's oracle: it drafts every speculative request's trees
        if proposer is not None:
            assert (proposer.num_beams, proposer.draft_len) == (tree.num_beams, tree.draft_len_per_beam), \
                f"proposer drafts {proposer.num_beams}x{proposer.draft_len}, engine trees are " \
                f"{tree.num_beams}x{tree.draft_len_per_beam}"
        if "inductor" in self.compiler.mode:
            keep_inductor_cache(engine_dir, dist.rank, dist.world_size)
        self.timer = PhaseTimer(dist.device, enabled=runtime.profile_phases)
        self.prompts = PromptPhase(self.steps, self.cache, self.state, tree, self.vocab_size, dist.device)
        self.launcher = StepLauncher(self.steps, self.compiler, self.cache, self.state, tree,
                                     self.build.max_batch_size, self.vocab_size, self.timer,
                                     trims_key_blocks=self.kernels == "torch",
                                     stops_early=runtime.draft_depth != "all")
        self.step_times = StepTimes()
        # the last decode step: (a tree step?, when it was read back, its seconds), None after a prompt step
        self._read_back: Optional[tuple[bool, float, float]] = None
        self._ids = itertools.count()
        self.outcomes: Optional[list[tuple[str, int, int, bool]]] = None  # a list: record verified nodes (tools)
        self.speculative = speculative
        if warmup and self.compiler.mode != "off":
            self.warmup(trees=speculative)
        spec = runtime.speculation
        self.policy = Policy(spec, tree.max_tree_tokens, self.cost_model() if spec.auto and speculative else None,
                             draft_beam_options(runtime.draft_beams, self.launcher.beam_options, tree.num_beams),
                             draft_depth_options(runtime.draft_depth, self.launcher.depth_options,
                                                 tree.draft_len_per_beam))

    @classmethod
    def load(cls, engine_dir: str | Path, dist: Dist, runtime: RuntimeConfig | None = None,
             proposer: Optional[Proposer] = None, warmup: bool = True, record_hidden: bool = False,
             speculative: bool = True) -> "Engine":
        """The engine of `engine_dir`, this rank's shard."""
        engine_dir = Path(engine_dir)
        cfg = load_engine_config(engine_dir)
        if cfg.tp_size != dist.world_size:
            raise UserError(f"engine {engine_dir} was built for tp={cfg.tp_size} but {dist.world_size} rank(s) are "
                            f"running; launch with mpirun -n {cfg.tp_size}.")
        path = engine_dir / f"rank{dist.rank}.safetensors"
        if not path.is_file():
            raise UserError(f"engine {engine_dir} has no {path.name}; rebuild it with build-engine.")
        return cls(cfg, load_file(str(path)), dist, runtime, proposer, warmup, record_hidden, engine_dir, speculative)

    # ---- warm-up and the cost model -------------------------------------------------------------------------------
    @property
    def default_proposer(self) -> Proposer:
        return self.override or self.proposers[self.cfg.proposer.proposer]

    def warmup(self, trees: bool = True) -> None:
        """Compile / capture the decode steps of the engine's default proposer before the first request: the AR step
        and (`trees`) every tree-step variant its requests can launch (other proposers' variants compile when first
        asked for); with the runtime's `warmup_guided`, those of requests with a grammar too."""
        guided = self.runtime.warmup_guided
        self.launcher.warmup(warmup_variants(self.default_proposer, guided=guided), trees, show=self.dist.is_driver,
                             guided=guided, words=self.grammars.words)

    def cost_model(self) -> costs.CostModel:
        """The step cost model of this engine on this machine: cached beside it, or measured now (every rank calls
        it: the measurement's steps are collective)."""
        key = costs.fingerprint(device=self.dist.device, engine=self.cfg.shape_key(), dtype=str(self.dtype),
                                drafter_dtype=str(self.drafter.dtype) if self.drafter is not None else None,
                                drafter_weights=self.drafter.weights if self.drafter is not None else None,
                                kernels=self.kernels, linear=self.linear, compile=self.compiler.mode,
                                cpp_wrapper=self.compiler.cpp_wrapper,
                                threads=torch.get_num_threads(), tp=self.dist.world_size)
        return costs.load_or_measure(self.launcher, self.dist, self.engine_dir, key, self.slots.free,
                                     self.build.max_seq_len, self.default_proposer.drafter is not None)

    # ---- requests -------------------------------------------------------------------------------------------------
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
        if not self.speculative and spec.mode != DecodingMode.AR:
            raise UserError(f"mode {spec.mode!r}: this engine was loaded for auto-regressive requests only (no tree "
                            f"step compiled, no step cost model); load it with speculative=True to serve both.")
        spec = dataclasses.replace(spec, mode=DecodingMode(spec.mode), prompt=list(spec.prompt),
                                   stop_sequences=tuple(tuple(q) for q in spec.stop_sequences if q))
        self.proposers[name].check(spec)
        self.build.check_request(spec.prompt, spec.params.max_tokens, self.vocab_size)
        if spec.params.top_logprobs > self.max_logprobs:
            raise UserError(f"top_logprobs={spec.params.top_logprobs} is above this engine's limit of "
                            f"{self.max_logprobs} (its max_logprobs); ask for at most {self.max_logprobs}, or serve "
                            f"with a larger --max-logprobs.")
        if spec.guide is not None and spec.params.resolved_acceptance is AcceptanceRule.APPLE:
            raise UserError("acceptance 'apple' cannot follow a grammar (its residual draws ignore the grammar's "
                            "masks); use acceptance 'exact', which samples the constrained distribution exactly.")
        grammar = self.grammars.start(spec.guide, spec.stop_ids) if spec.guide is not None else None
        sid = next(self._ids) if seq_id is None else seq_id
        if self.cache.has(sid):  # two live sequences under one id would share KV blocks
            raise ValueError(f"sequence id {sid!r} already holds KV blocks on this engine; release it first")
        return Sequence(sid, spec, self.build.max_seq_len, proposer=name, grammar=grammar)

    def hidden_states(self, seqs: list[Sequence]) -> torch.Tensor:
        """[len(seqs), H] float32 on the CPU: the final-norm hidden state of the token each request's last step
        verified (its last prompt token after the prompt step, its true token after an AR step), the state whose
        logits chose the token that step emitted. Needs `record_hidden`; not written by tree steps."""
        if self.state.hidden is None:
            raise RuntimeError("this engine was made without record_hidden=True")
        idx = torch.tensor([s.slot for s in seqs], dtype=torch.long, device=self.state.hidden.device)
        return self.state.hidden[idx].float().cpu()

    # ---- the step -------------------------------------------------------------------------------------------------
    def decide(self, seqs: list[Sequence]) -> StepDecision:
        """The policy's step for these requests' decoding ones (those past their prompt); the scheduler calls it on
        rank 0 and broadcasts the decision with the step plan. A batch without a speculative request takes an AR step
        without asking (the policy's state does not move for one)."""
        cands, proposers = [], []
        for s in seqs:
            if s.in_prompt_phase:
                continue
            if not s.speculative:
                cands.append(Candidate(s.seq_id, False, None, context=s.ctx_len))
                continue
            tree = s.tree
            cands.append(Candidate(s.seq_id, True, tree.scores if tree else None,
                                   self.policy.calibration(s.proposer, s.sampling.greedy), fresh=s.tree_fresh,
                                   whole_tree=s.apple, context=s.ctx_len, beams=tree.beams if tree else None,
                                   depths=tree.depths if tree else None))
            proposers.append(self.proposer_of(s))
        if not proposers:
            return AR_STEP
        return self.policy.decide(cands, drafts_on_device(proposers))

    @torch.inference_mode()
    def step(self, seqs: list[Sequence], decision: Optional[StepDecision] = None) -> list[StepEvent]:
        """One step for every given request, as `decision` says (default: this rank's policy decides; under TP every
        rank is given rank 0's): plan (slots and KV) -> launch and parse (decode, prompt) -> commit -> next trees."""
        assert seqs and all(not s.finished for s in seqs), [s.seq_id for s in seqs]
        self.slots.admit(seqs)
        prompt = [s for s in seqs if s.in_prompt_phase]
        decode = [s for s in seqs if not s.in_prompt_phase]
        out: dict[Hashable, Emitted] = {}
        if decode:
            out.update(self._decode(decode, decision if decision is not None else self.decide(decode)))
        if prompt:
            out.update(self._prefill(prompt))
        events = [self._commit(s, out[s.seq_id]) for s in seqs]
        self._compose_on_host([(s, out[s.seq_id].host) for s in seqs if out[s.seq_id].host and not s.finished])
        self._follow_grammars([s for s in seqs if s.grammar is not None and s.speculative and not s.finished
                               and not s.in_prompt_phase])  # a prompt chunk emits no token: nothing to follow yet
        self.policy.end_step()
        return events

    def _commit(self, s: Sequence, emitted: Emitted) -> StepEvent:
        """Append a step's tokens (and their log-probabilities) to `s` (stops and limits applied) and count them. A
        prompt step that computed only a chunk of the prompt emits nothing: the request stays in its prompt phase."""
        tokens = emitted.tokens
        if s.in_prompt_phase and not tokens:
            return StepEvent(s.seq_id, [], False)
        if s.in_prompt_phase:
            s.prefilled, s.ctx_len = True, len(s.prompt) + len(s.output)
            appended = s.append(tokens)
            s.stats.first_token_time = time.perf_counter()
        else:
            s.ctx_len += len(tokens)
            appended = s.append(tokens)
            s.stats.steps += 1
            s.stats.generated_in_steps += len(appended)
        if emitted.logprobs is not None:  # aligned with `output`: the appended tokens' only
            s.output_logprobs += emitted.logprobs[:len(appended)]
        return StepEvent(s.seq_id, appended, s.finished)

    def _decode(self, group: list[Sequence], decision: StepDecision) -> dict[Hashable, Emitted]:
        """One decode step for `group`: launch, read back (the step's one host sync), parse each request's row."""
        t0 = time.perf_counter()
        if self._read_back is not None:  # the host's time since the last decode step (none: a prompt step between)
            after_tree, at, last_took = self._read_back
            if t0 - at <= max(BETWEEN_STEPS_MAX_S, last_took):  # longer: the scheduler waited for work
                self.policy.observe_between(after_tree, 1e3 * (t0 - at))
        with_logprobs = any(s.sampling.wants_logprobs for s in group)
        out, layout = self._launch(decision, group, with_logprobs)
        rows = out.cpu().tolist()
        done = time.perf_counter()
        took = done - t0
        self._read_back = (decision.is_tree, done, took)
        self.step_times.add("tree" if decision.is_tree else "ar", took)
        self.step_times.widths[decision.width] += 1
        if layout is not None and layout.draft:
            self.step_times.beams[decision.beams or self.tree.num_beams] += 1
            self.step_times.depths[decision.depth or self.tree.draft_len_per_beam] += 1
        self.policy.observe_step(decision, len(group), sum(s.ctx_len for s in group) / len(group), 1e3 * took)
        emitted = {}
        # each row's log-probability columns come last: one emitted token's worth per AR row, bl per tree row
        lp_width = token_logprobs.columns(self.max_logprobs) * (self.tree.beam_length if decision.is_tree else 1)
        for s, row in zip(group, rows):
            cols = None
            if with_logprobs:
                row, cols = row[:len(row) - lp_width], row[len(row) - lp_width:]
            verified = s.tree if s.tree_fresh else None
            s.tree_fresh, s.pending = False, None  # the tree is the last one it had, until a new one is drafted
            r = layout.parse(row) if layout is not None else None  # an AR step's row: [token | 1 | 0]
            kept = decision.keep.get(s.seq_id, 1)
            if s.speculative and r is not None and kept > 1 and verified is not None:
                self._record(s, verified, kept, r.path)
            if s.grammar is not None and r is not None and r.draft is not None:
                s.grammar.hold(r.draft.rows, r.draft.scores)
            host = self.proposer_of(s).after_step(s, r, decision.compose) if s.speculative else None
            tokens = r.tokens if r is not None else row[:1]
            emitted[s.seq_id] = Emitted(tokens, host, self._logprobs(s, cols, len(tokens)))
        return emitted

    def _logprobs(self, s: Sequence, cols: Optional[list[int]], n: int) -> Optional[list[TokenLogprob]]:
        """`s`'s n emitted tokens' log-probabilities from its row's columns, where it asked for them."""
        if cols is None or not s.sampling.wants_logprobs:
            return None
        return token_logprobs.decode(cols, n, self.max_logprobs, s.sampling.top_logprobs)

    def _launch(self, decision: StepDecision, group: list[Sequence], with_logprobs: bool
                ) -> tuple[torch.Tensor, Optional[RowLayout]]:
        """Start one decode step for `group` -> (its output rows on the device, maybe still running; their layout,
        None for an AR step)."""
        rule, slots = self._rule(group), [s.slot for s in group]
        longest = max(s.ctx_len for s in group)
        if not decision.is_tree:
            return self.launcher.ar(slots, longest + 1, rule, with_logprobs, self._masks(group, None)), None
        pending = [s.pending for s in group]
        keep = [decision.keep.get(s.seq_id, 1) for s in group]
        masks = self._masks(group, keep)
        variant = variant_for(True, rule, self._speculating_proposers(group), decision.draft,
                              any(p is not None for p in pending), with_logprobs, masks is not None)
        out = self.launcher.tree(slots, decision.width, keep, longest, variant, pending, masks, decision.beams,
                                 decision.depth)
        tree = self.tree
        return out, RowLayout(tree.beam_length, tree.max_tree_tokens, variant.draft,
                              tree.num_beams * tree.beam_length if variant.return_beams else 0)

    def _masks(self, group: list[Sequence], keep: Optional[list[int]]) -> Optional[torch.Tensor]:
        """The token bitmasks of a step over `group` (grammar.py: keep None for a prompt or AR step), where some
        request has a grammar."""
        return self.grammars.masks(group, keep) if any(s.grammar is not None for s in group) else None

    def _prefill(self, seqs: list[Sequence]) -> dict[Hashable, Emitted]:
        """Prompt step (prompt.py) for newly admitted (or preempted) requests -> their first tokens, their first trees
        drafted on the device and handed to their proposers. A request whose `prefill_chunk` ends before its prompt
        does computes only that chunk (chunked prefill): it emits nothing and continues from there next step."""
        self._read_back = None  # the time until the next decode step is not the host's
        self.policy.observe_prompt_step()
        partial = [s for s in seqs if not PromptPhase.ends(s)]
        whole = [s for s in seqs if PromptPhase.ends(s)]
        if partial:
            self.prompts.chunks(partial)
        out = {s.seq_id: Emitted([]) for s in partial}
        if not whole:
            return out
        rule = self._rule(whole)
        slots, h, first, cols = self.prompts.last(whole, rule, any(s.sampling.wants_logprobs for s in whole),
                                                  self._masks(whole, None))
        nodes, beams = self.prompts.first_trees(slots, h, rule, [self._drafting([s]) for s in whole], [
            s.grammar is not None or returns_device_beams([self.proposer_of(s)]) for s in whole])
        for i, s in enumerate(whole):
            if s.grammar is not None and i in beams:
                s.grammar.hold(beams[i].rows, beams[i].scores)
            host = self.proposer_of(s).after_prompt(s, nodes.get(i), beams.get(i)) if s.speculative else None
            out[s.seq_id] = Emitted([first[i]], host, self._logprobs(s, cols[i], 1))
        return out

    def _record(self, s: Sequence, verified: TreeNodes, kept: int, path: list[int]) -> None:
        """Statistics and the policy's calibration from one verified tree: its first `kept` nodes were verified, the
        ones at tree indices path[1:] accepted."""
        n = min(kept, len(verified))
        s.stats.accepted_draft_tokens += len(path) - 1
        s.stats.draft_tokens += max(verified.depths[:n])
        self.policy.calibration(s.proposer, s.sampling.greedy).observe(
            verified.scores[1:n], [verified.scores[i] for i in path[1:]], verified.depths[1:n],
            [verified.depths[i] for i in path[1:]])
        if self.outcomes is not None:  # every verified node: (proposer, score, depth, accepted)
            accepted = set(path[1:])
            self.outcomes += [(s.proposer, verified.scores[i], verified.depths[i], i in accepted) for i in range(1, n)]

    # ---- proposers ------------------------------------------------------------------------------------------------
    def _speculating_proposers(self, seqs: list[Sequence]) -> list[Proposer]:
        return [self.proposer_of(s) for s in seqs if s.speculative]

    def _drafting(self, seqs: list[Sequence]) -> bool:
        """Whether the device drafter runs for these requests (some speculative one's proposer drafts on it)."""
        return drafts_on_device(self._speculating_proposers(seqs))

    def _compose_on_host(self, work: list[tuple[Sequence, HostCompose]]) -> None:
        """The next tree of each request whose proposer composes it on the host (packed by its next tree step), from
        the device's draft where it has one; a proposer's None keeps the tree the step packed (or leaves none)."""
        if not work:
            return
        t0 = time.perf_counter()
        for s, host in work:
            draft = self.proposer_of(s).compose(s, host.device)
            if draft is not None:
                s.pending, s.tree, s.tree_fresh = draft, draft.nodes(), True
                if s.grammar is not None:
                    s.grammar.hold(draft.rows, draft.scores)
        took = time.perf_counter() - t0
        self.step_times.add("propose", took)
        self.policy.observe_host(1e3 * took / len(work))

    def _follow_grammars(self, seqs: list[Sequence]) -> None:
        """Grammar-aware drafting: the fresh trees of constrained requests repaired to follow their grammars (forbidden
        drafts cut, forced tokens put in), and trees of forced tokens for those the step drafted none for (grammar.py);
        composed on the host and packed by their next tree steps."""
        for s, rows, scores in self.grammars.follow(seqs, SCORE_FLOOR):
            s.pending = Draft(rows, scores)
            s.tree, s.tree_fresh = s.pending.nodes(), True

    def _rule(self, group: list[Sequence]) -> AcceptanceRule:
        """The batch's acceptance rule, in the requests' vocabulary (config.ACCEPTANCE_RULES): apple (some speculative
        request asks for it), greedy (every request is greedy) or exact (counter-based draws per node; greedy rows take
        their argmax through them)."""
        if any(s.apple for s in group):
            return AcceptanceRule.APPLE
        return AcceptanceRule.GREEDY if all(s.sampling.greedy for s in group) else AcceptanceRule.EXACT
