"""Launching decode steps: which compiled unit runs a step (`StepVariant`), its inputs at the shapes the compile mode
wants, and compiling every variant the engine can launch before the first request (warm-up).

The engine decides what a step does (the policy's `StepDecision`, each request's proposer); `StepLauncher` runs it:
one `graphs.Unit` per step kind, compiled (inductor) or captured (CUDA graphs, per batch bucket and tree width) on
first use. `variant_for` is the one place that turns a step's facts into a variant: the engine calls it for every
launch and the warm-up for every case a proposer can produce, so a variant that can be launched is one that was
compiled.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch

from ..config import AcceptanceRule, ReDrafterConfig
from ..decoding import bitmask
from ..errors import UserError
from ..log import get_logger
from .graphs import Compiler, batch_buckets, beam_buckets, bucket_for, depth_buckets, tree_buckets
from .kv_cache import PagedKVCache
from .proposer import Proposer, drafts_on_device, returns_device_beams
from .sequence import Draft
from .state import SlotState
from .step import DecodeStep
from .timing import PhaseTimer

logger = get_logger(__name__)


@dataclass(frozen=True)
class StepVariant:
    """What selects a decode step's compiled graph besides its shapes: an AR step or a tree step, the batch's
    acceptance rule (greedy | exact | apple), and for a tree step whether the device drafter drafts the next trees
    (`draft`), whether its beams come back to the host too (`return_beams`: mixed trees are composed from them) and
    whether trees composed on the host are packed first (`host_trees`); for either kind, whether the emitted tokens'
    log-probabilities come back too (`logprobs`: some request of the batch asked for them) and whether token bitmasks
    constrain the choice (`grammar`: some request has a grammar). The warm-up compiles the variants without
    log-probabilities or grammars; one with them compiles when a request first asks."""

    tree: bool
    rule: AcceptanceRule = AcceptanceRule.GREEDY
    draft: bool = False
    return_beams: bool = False
    host_trees: bool = False
    logprobs: bool = False
    grammar: bool = False


def variant_for(tree: bool, rule: AcceptanceRule, proposers: Iterable[Proposer], may_draft: bool, host_trees: bool,
                logprobs: bool = False, grammar: bool = False) -> StepVariant:
    """The variant of a step over requests with these proposers (the speculative ones'): the device drafter runs
    where the decision lets it (`may_draft`) and some proposer drafts on the device. Its beams come back to the host
    where a proposer composes from them, or a grammar masks the tree they make (the host walks it)."""
    if not tree:
        return StepVariant(False, rule, logprobs=logprobs, grammar=grammar)
    props = list(proposers)
    draft = may_draft and drafts_on_device(props)
    return StepVariant(True, rule, draft, draft and (grammar or returns_device_beams(props)), host_trees, logprobs,
                       grammar)


def warmup_variants(proposer: Proposer, rule: AcceptanceRule = AcceptanceRule.GREEDY, guided: bool = False
                    ) -> list[StepVariant]:
    """Every tree-step variant a batch of `proposer`'s requests can launch: with host-composed trees where it composes
    them, and without where its trees may come from the device (or from nowhere, for a step that only drafts); with
    `guided`, those of requests with a grammar too (their trees may be composed on the host, repaired to follow it)."""
    out = [variant_for(True, rule, [proposer], True, h) for h in proposer.host_tree_cases()]
    if guided:
        out += [variant_for(True, rule, [proposer], True, h, grammar=True) for h in (True, False)]
    return list(dict.fromkeys(out))


def _builds(unit) -> int:
    """Graphs built so far: dynamo's compiled graphs (all units) and this unit's CUDA-graph captures."""
    from torch._dynamo.utils import counters  # here: importing the runtime must not import dynamo (test_plugins)
    return counters["stats"]["unique_graphs"] + len(getattr(unit, "graphs", ()))


def draft_depth_options(spec: str, options: list[int], draft_len: int) -> list[int]:
    """The draft depths the policy may draft to, as `--draft-depth` says: all (draft_len), auto (`options`, the
    launcher's), or N, which must be one of `options`."""
    return _draft_options(spec, options, draft_len, "--draft-depth", "to depth {}", "its beams draft {} tokens",
                          "a step stops drafting early only on the CPU, eager or inductor")


def draft_beam_options(spec: str, options: list[int], num_beams: int) -> list[int]:
    """The beam counts the policy may draft with, as `--draft-beams` says: all (num_beams), auto (`options`, the
    launcher's), or N, which must be one of `options`."""
    return _draft_options(spec, options, num_beams, "--draft-beams", "{} beams", "its trees have {}",
                          "one compiled step drafts other counts only on the CPU: eager or inductor")


def _draft_options(spec: str, options: list[int], whole: int, flag: str, can: str, has: str, why: str) -> list[int]:
    if spec == "all":
        return [whole]
    if spec == "auto":
        return options
    fixed = int(spec)
    if fixed not in options:
        where = "" if len(options) > 1 else f" ({why})"
        raise UserError(f"{flag} {fixed}: this engine's steps can draft {can.format(', '.join(map(str, options)))}"
                        f"{where} ({has.format(whole)}); use one of those, all, or auto to let the speculation policy "
                        f"choose.")
    return [fixed]


class StepLauncher:
    """Runs the decode steps of `DecodeStep` for batches of slots: the AR step and the tree step, each through one
    compiled / captured unit per variant."""

    def __init__(self, steps: DecodeStep, compiler: Compiler, cache: PagedKVCache, state: SlotState,
                 tree: ReDrafterConfig, max_batch_size: int, vocab_size: int, timer: PhaseTimer,
                 trims_key_blocks: bool, stops_early: bool = True):
        """`stops_early`: steps may draft less deep than the tree (`--draft-depth` other than all), where they can
        (`depth_options`); without it the step drafts the whole depth, with no per-depth rows in its graph."""
        self.steps, self.compiler, self.cache, self.state = steps, compiler, cache, state
        self.tree_shape = tree
        self.vocab_size, self.timer = vocab_size, timer
        self.device = cache.device
        self.buckets = batch_buckets(max_batch_size)
        self.widths = tree_buckets(tree.max_tree_tokens)
        # whether steps pass only the KV blocks the longest request needs: the torch attention reads every block it
        # is given; the Triton and CPU kernels stop at each request's length, and CUDA graphs want static shapes
        self.trims_key_blocks = trims_key_blocks and not compiler.uses_graphs
        self._units: dict[object, Callable] = {}
        # beam counts a drafting step may search (`beam_buckets`) where one compiled step serves them all
        # (`Compiler.any_width`: the count is an unbacked size, as the width is); else the tree's nb only
        nb = tree.num_beams
        self.beam_options = beam_buckets(nb) if compiler.any_width else [nb]
        # draft depths a drafting step may stop at (`beam_search`'s depth_rows, also unbacked sizes) where one compiled
        # step serves them all, on the CPU (a layer over zero rows reads no weight there; the fused beam_draft kernel
        # stops at the first empty one)
        dl = tree.draft_len_per_beam
        any_depth = stops_early and steps.proposer is not None
        self.depth_options = depth_buckets(dl) if compiler.any_width and any_depth and self.device.type == "cpu" \
            else [dl]

    # ---- the two step kinds ------------------------------------------------------------------------------------
    def ar(self, slots: list[int], longest: int, rule: AcceptanceRule, logprobs: bool = False,
           grammar: Optional[torch.Tensor] = None) -> torch.Tensor:
        """An AR step for these slots -> their output rows (on the device, maybe still running). grammar
        [len(slots), words]: token bitmasks (structured output)."""
        args = self._inputs(slots, 1, longest, any_batch=True)
        return self._unit(False, rule)(*args[:2], rule, logprobs, self._padded(grammar, args[0].shape[0]))[:len(slots)]

    def tree(self, slots: list[int], width: int, keep: list[int], longest: int, variant: StepVariant,
             pending: Optional[list[Optional[Draft]]] = None, grammar: Optional[torch.Tensor] = None,
             beams: int = 0, depth: int = 0) -> torch.Tensor:
        """A tree step: the first `width` nodes of each slot's tree (each counting keep[i] of them), over contexts up
        to `longest` committed positions; `pending`: the trees the host composed, per slot (None: the stored one);
        grammar [len(slots), nb, bl, words]: the token bitmasks of the trees' nodes, in beam layout; `beams`: how
        many beams the drafter searches for the next trees (one of `beam_options`; 0: all nb); `depth`: how many
        tokens deep (one of `depth_options`; 0: all dl; where the beams come back to the host, always all)."""
        if variant.rule is AcceptanceRule.APPLE:
            self.state.ensure_draft_logp(self.vocab_size)
        T = self.verify_width(width, max(keep))
        args = self._inputs(slots, T, longest + T, keep)
        host = self._host_inputs(pending, args[0].shape[0]) if variant.host_trees else (None, None, None)
        call = (*args, variant.rule, variant.draft, variant.return_beams, variant.logprobs, *host,
                self._padded(grammar, args[0].shape[0]), self._draft_beams(variant, beams),
                self._draft_depth(variant, args[0].shape[0] * (beams or self.tree_shape.num_beams), depth))
        if self.timer.enabled:  # each phase its own unit, timed
            out = self.steps.redrafter_step(*call, run=self._timed_phase)
            self.timer.end_step()
        else:
            out = self._unit(True, variant.rule)(*call)
        return out[:len(slots)]

    def verify_width(self, width: int, kept: int) -> int:
        """Tree nodes a step verifies: the bucket's width under CUDA graphs (captured shapes), else just the nodes
        some request keeps: down to the root alone where one compiled graph serves every width
        (`Compiler.any_width`), else at least 2 (inductor on CUDA would specialize a width of 1, and compile a graph
        of its own for what one more node costs)."""
        if self.compiler.uses_graphs:
            return width
        return kept if self.compiler.any_width else max(2, kept)

    def _draft_beams(self, variant: StepVariant, beams: int) -> Optional[torch.Tensor]:
        """[k]: the drafter searches k = `beams` (0: nb) beams; None where the step drafts nothing or the count is
        static: CUDA graphs and inductor on CUDA (nb), and trees of one beam (an unbacked size whose only value is 1
        would not compile)."""
        nb = self.tree_shape.num_beams
        if beams not in (0, *self.beam_options):
            raise ValueError(f"a step may draft {self.beam_options} beams, not {beams}")
        if not variant.draft or len(self.beam_options) < 2:
            return None
        k = torch.arange(beams or nb, device=self.device)
        self.compiler.mark_width(k)
        return k

    def _draft_depth(self, variant: StepVariant, rows: int, depth: int) -> Optional[list[torch.Tensor]]:
        """`beam_search`'s depth_rows for a search of `depth` (0: dl) tokens over `rows` beams: dl - 1 index tensors,
        arange(rows) for each drafting step that runs and empty ones after. None where the step drafts nothing, the
        depth is static (`depth_options`), the beams come back to the host (mixed trees and grammars compose from
        whole beams) or the rule reads the drafter's distributions (`apple`)."""
        dl = self.tree_shape.draft_len_per_beam
        if depth not in (0, *self.depth_options):
            raise ValueError(f"a step may draft to depth {self.depth_options}, not {depth}")
        if not variant.draft or variant.return_beams or variant.rule is AcceptanceRule.APPLE \
                or len(self.depth_options) < 2:
            return None
        d = depth or dl
        out = [torch.arange(rows if t < d else 0, device=self.device) for t in range(1, dl)]
        for idx in out:
            self.compiler.mark_width(idx)
        return out

    # ---- warm-up -----------------------------------------------------------------------------------------------
    def warmup(self, variants: list[StepVariant], trees: bool = True, show: bool = True, guided: bool = False,
               words: int = 0) -> None:
        """Compile / capture the AR step and (`trees`) every given tree-step variant before the first request, on
        padding-slot batches: at every tree width the policy may choose and every batch bucket under CUDA graphs; at
        two batch sizes (one, and more: inductor specializes size 1, but for the CPU's AR step, one graph:
        `Compiler.mark_any_batch`) otherwise. `guided`: the AR step with token
        bitmasks too (`words` int32 words per row; the tree variants with grammars are among `variants`)."""
        from tqdm import tqdm

        t0 = time.perf_counter()
        sizes = self.buckets if self.compiler.uses_graphs else sorted({1, min(2, self.buckets[-1])})
        widths = self.widths if self.compiler.uses_graphs else [self.verify_width(0, self.tree_shape.max_tree_tokens)]
        ar = [StepVariant(False)] + ([StepVariant(False, grammar=True)] if guided else [])
        work = [(bs, v, 0) for bs in sorted(sizes, reverse=True) for v in ar]
        if trees:
            work += [(bs, v, T) for bs in sorted(sizes, reverse=True) for T in widths for v in variants]
        pad = self.state.padding_slot
        nb, bl = self.tree_shape.num_beams, self.tree_shape.beam_length
        with torch.inference_mode():  # largest batches first: later captures reuse their pool memory
            for bs, variant, T in tqdm(work, desc=f"compiling decode steps ({self.compiler.mode})", unit="graph",
                                       disable=not show or None, leave=False):
                masks = bitmask.full(bs, *((nb, bl) if variant.tree else ()), words) if variant.grammar else None
                if not variant.tree:
                    self.ar([pad] * bs, 1, variant.rule, grammar=masks).cpu()
                else:
                    self.tree([pad] * bs, T, [T] * bs, 0, variant, [Draft.empty(nb, bl)] * bs, masks).cpu()
        logger.info("engine warm-up (%s, buckets %s, tree widths %s) took %.1fs", self.compiler.mode, sizes,
                    widths if trees else "none: AR steps only", time.perf_counter() - t0)

    # ---- inputs and units --------------------------------------------------------------------------------------
    def _inputs(self, slots: list[int], T: int, longest: int, keep: Optional[list[int]] = None,
                any_batch: bool = False) -> tuple[torch.Tensor, ...]:
        """(slots, key_blocks, tree_width, keep) of a decode step: slots padded to a batch bucket under CUDA graphs
        (padding rows keep their root), and every varying size marked dynamic for inductor; `any_batch`: the batch
        as `Compiler.mark_any_batch` marks it (the AR step's)."""
        pad = bucket_for(len(slots), self.buckets) - len(slots) if self.compiler.uses_graphs else 0
        keep = (keep or [1] * len(slots)) + [1] * pad
        dev = self.device
        args = (torch.tensor(slots + [self.state.padding_slot] * pad, dtype=torch.long, device=dev),
                self._key_blocks(longest), torch.arange(T, device=dev),
                torch.tensor(keep, dtype=torch.long, device=dev))
        # key_blocks varies only where the attention reads every block it is given
        varying = (args[1], args[3]) if self.trims_key_blocks else (args[3],)
        if any_batch:
            self.compiler.mark_any_batch(args[0])
        else:
            varying = (args[0], *varying)
        self.compiler.mark_dynamic(*varying)
        self.compiler.mark_width(args[2])
        return args

    def _key_blocks(self, longest: int) -> torch.Tensor:
        """[nblk]: how many KV blocks per request the attention is given. All of them where the kernels stop at each
        request's length or shapes are static; else enough for `longest` positions, at least 2 so that inductor's
        one dynamic graph covers every length (size 1 would specialize)."""
        n = self.cache.max_blocks_per_seq
        if self.trims_key_blocks:
            n = min(max(2, -(-longest // self.cache.block_size)), n)
        return torch.arange(n, device=self.device)

    def _host_inputs(self, pending: Optional[list[Optional[Draft]]], n: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(host_beams [n, nb, bl], host_scores [n, nb, dl], host_mask [n]) of the trees composed on the host; rows
        without one (and padding rows) pack their stored beams."""
        rows = list(pending or [])
        rows += [None] * (n - len(rows))
        empty = Draft.empty(self.tree_shape.num_beams, self.tree_shape.beam_length)
        drafts = [p if p is not None else empty for p in rows]
        mask = [p is not None for p in rows]
        beams = torch.tensor([d.rows for d in drafts], dtype=torch.long).to(self.device)
        scores = torch.tensor([d.scores for d in drafts], dtype=torch.long).to(self.device)
        mask_t = torch.tensor(mask).to(self.device)
        self.compiler.mark_dynamic(beams, scores, mask_t)
        return beams, scores, mask_t

    def _padded(self, grammar: Optional[torch.Tensor], n: int) -> Optional[torch.Tensor]:
        """Token bitmasks on the device, padded to the step's n rows (padding rows allow every token)."""
        if grammar is None:
            return None
        if grammar.shape[0] < n:
            grammar = torch.cat([grammar, grammar.new_full((n - grammar.shape[0], *grammar.shape[1:]), -1)])
        grammar = grammar.to(self.device)
        self.compiler.mark_dynamic(grammar)
        return grammar

    def _unit(self, tree: bool, rule: AcceptanceRule) -> Callable:
        """The unit of AR or tree steps under `rule`: one for greedy steps, one for sampled ones (they draw noise,
        compiled with other options: `graphs.Unit`'s `draws`)."""
        key = (tree, rule is not AcceptanceRule.GREEDY)
        unit = self._units.get(key)
        if unit is None:
            fn = self.steps.redrafter_step if tree else self.steps.ar_step
            name = f"{'tree' if tree else 'ar'}-step{'-sampled' if key[1] else ''}"
            unit = self._units[key] = self.compiler.unit(fn, name, self._on_padding, draws=key[1])
        return unit

    def _timed_phase(self, name: str, phase, *args):
        """One phase of a profiled step, run as its own unit (compiled / captured) and timed. A sampled step's
        accept phase draws noise: a unit of its own, as whole steps have one (`_unit`)."""
        draws = any(isinstance(a, AcceptanceRule) and a is not AcceptanceRule.GREEDY for a in args)
        key = (name, phase.__name__, draws)  # "pack" is the device's beams, or the host's (pack_host)
        unit = self._units.get(key)
        if unit is None:  # drafting writes no state: its capture needs no padding-slot arguments
            unit = self._units[key] = self.compiler.unit(phase, name, None if name == "draft" else self._on_padding,
                                                         draws)
        built = _builds(unit)
        with self.timer.phase(name):
            out = unit(*args)
        if _builds(unit) != built:  # compiled or captured for a shape first seen: not a step to count
            self.timer.discard_step()
        return out

    def _on_padding(self, slots: torch.Tensor, *rest):
        """The same call on padding slots only (what a CUDA-graph capture may run for real)."""
        return (torch.full_like(slots, self.state.padding_slot), *rest)
