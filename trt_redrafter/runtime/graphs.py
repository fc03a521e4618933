"""Running a step function fast: eager, `torch.compile` (inductor), CUDA graphs, or both.

A `Unit` wraps a function of tensors whose shapes the caller keeps static per call site (batch buckets, trees
padded to `max_tree_tokens`). By the runtime's `compile` setting:
    off                  call it (eager PyTorch; Python runs once per op)
    inductor             `torch.compile` it (CPU: C++ kernels called from a C++ wrapper, `cpp_wrapper`; CUDA: Triton
                         kernels), Python runs once per step
    cudagraphs           capture it once per input signature with `torch.cuda.CUDAGraph`, then replay: one launch
                         per step instead of hundreds (gpt-fast's "reduce-overhead", captured explicitly as vLLM
                         does, because the step mutates persistent state that "reduce-overhead" would copy)
    inductor+cudagraphs  capture the inductor-compiled function
    auto                 cudagraphs on CUDA, inductor on a one-rank CPU engine, off for TP > 1 on the CPU
                         (`resolve_compile_mode`)

A captured graph reads its inputs from static buffers (each call copies its arguments in) and returns the same
output tensors every replay: the caller consumes them before the next call of that unit. All graphs share one
memory pool; outputs stay referenced, so one graph's results are never another's scratch space.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Optional

import torch
import torch.utils._pytree as pytree

from ..errors import UserError
from ..log import get_logger

logger = get_logger(__name__)

WARMUP_CALLS = 2  # eager/compiled calls before a capture (lazy inits, autotuning, compilation)
# inductor's `realize_opcount_threshold` for the graphs that draw noise (`Unit`'s `draws`): a value used more than
# once is stored once it takes more than this many ops, instead of being inlined into each use (CPU default: 50)
DRAWS_REALIZE_OPS = 8
# the hint of a tree step's unbacked width on the CPU (`Compiler.mark_width`): what inductor sizes its kernels'
# threading for
WIDTH_HINT = 1


def uses_graphs(mode: str) -> bool:
    return "cudagraphs" in mode


def resolve_compile_mode(mode: str, device: torch.device, world_size: int = 1) -> str:
    """`auto`: CUDA graphs on CUDA; inductor on a one-rank CPU engine; eager for TP > 1 on the CPU, where every step
    waits on gloo collectives that compilation cannot remove, so compiling costs minutes of warm-up and its steps
    are no faster (docs/perf-history.md has the measurement)."""
    if mode == "auto":
        if device.type == "cuda":
            return "cudagraphs"
        return "inductor" if world_size == 1 else "off"
    if uses_graphs(mode) and device.type != "cuda":
        raise UserError(f"--compile {mode} needs a CUDA device, but this engine runs on {device}; "
                        f"use --compile inductor or off on the CPU.")
    return mode


def cpp_wrapper(mode: str, device: torch.device) -> bool:
    """Whether inductor writes a compiled step's wrapper (the code that allocates buffers and calls each kernel) in
    C++ instead of Python: on the CPU, unless TRT_REDRAFTER_CPP_WRAPPER=0. A step calls over a thousand kernels (a
    30-layer model's linears and attentions, and the drafting, accept and pack ops around them); the Python wrapper
    spends a few microseconds on each, and with it an AR step that follows tree steps ran slower than one that
    follows AR steps (SmolLM2, 2 cores: 16.4 against 13.3 ms; docs/perf-history.md, 2026-11-29)."""
    return "inductor" in mode and device.type == "cpu" and os.environ.get("TRT_REDRAFTER_CPP_WRAPPER", "1") != "0"


def _configure_dynamo() -> None:
    import torch._dynamo.config as dc

    # one compiled graph per (step kind, acceptance rule, batch specialization): more than the default 8
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dc, name):
            setattr(dc, name, max(getattr(dc, name), 64))
            break


def _arguments_only(entries) -> list[bool]:
    """Guard only what varies between calls: the arguments (their shapes, the static variant values) and global
    state. A unit is a bound method of one engine whose model, cache and state objects never change after loading,
    so re-checking the hundreds of tensors reachable through `self` (dozens of microseconds per step on a CPU) buys
    nothing."""
    def root(name: str) -> str:  # "slots", "L['slots']", "self.cache.k[0]" -> slots, slots, self
        name = name[3:] if name.startswith("L['") else name
        return name.split(".")[0].split("[")[0].split("'")[0]

    return [e.name == "" or root(e.name) not in ("self", "G") for e in entries]


def _own_code(fn: Callable) -> Callable:
    """`fn` with a code object of its own. Dynamo keeps compiled graphs per code object, and `_arguments_only` drops
    the guards on `self`: without this, a second engine in the same process (other shapes, other tensors) would
    run the first engine's graphs for the same method."""
    import types

    func, owner = (fn.__func__, fn.__self__) if isinstance(fn, types.MethodType) else (fn, None)
    own = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__,
                             func.__closure__)
    own.__kwdefaults__, own.__qualname__ = func.__kwdefaults__, func.__qualname__
    return types.MethodType(own, owner) if owner is not None else own


class Unit:
    """One step function under one compile mode; see the module docstring. `fn` takes tensors and hashable static
    values (variants: a new value compiles / captures a new graph)."""

    def __init__(self, fn: Callable, mode: str, device: torch.device, name: str, pool=None,
                 neutral: Optional[Callable] = None, draws: bool = False):
        self.mode, self.device, self.name, self.draws = mode, device, name, draws
        # capture runs `fn` for real (warm-up calls): on arguments mapped by `neutral`, so a graph first needed in
        # the middle of serving never advances live requests (the engine maps slots to the padding slot)
        self.neutral = neutral
        self.compiled = fn
        if mode in ("inductor", "inductor+cudagraphs"):
            _configure_dynamo()
            options = {"guard_filter_fn": _arguments_only}
            if device.type == "cpu":
                # round bf16/fp16 intermediates where eager does: inductor otherwise keeps a fused kernel's values
                # in fp32, so a token's bits depend on how the step's graph was fused, which differs between the
                # AR and the tree graphs (greedy bf16 ReDrafter then left AR; with this, compiled == eager)
                options["emulate_precision_casts"] = True
            # no runtime checks of each external kernel's output size, stride and alignment in the generated wrapper:
            # a tree step calls hundreds of them (a 30-layer model's linears and attentions), a Python call each,
            # which on a CPU is a sizeable share of a small model's whole step. The custom ops' fake functions they
            # would check are tested by the compiled == eager parity tests.
            options.update(size_asserts=False, alignment_asserts=False, scalar_asserts=False)
            options["cpp_wrapper"] = cpp_wrapper(mode, device)
            if draws and device.type == "cpu":
                # the counter-based noise of sampled steps (decoding/sampling.py) is rounds of lowbias32, each using
                # its input twice: inlined into both uses, a round's ops doubled at each round, and inductor traced
                # and generated them all before its common-subexpression pass removed the copies. Stored instead,
                # the noise alone compiles in 11 s instead of 58 s on a 2-core AVX2 CPU (a sampled AR step 31 s
                # instead of 95 s) and runs as fast (docs/perf-history.md, 2026-12-01). Greedy graphs draw nothing
                # and keep inductor's default.
                options["realize_opcount_threshold"] = DRAWS_REALIZE_OPS
            self.compiled = torch.compile(_own_code(fn), dynamic=None, fullgraph=False, options=options)
        self.pool = pool
        self.graphs: dict[Any, tuple[torch.cuda.CUDAGraph, list[torch.Tensor], Any]] = {}

    def __call__(self, *args):
        if not uses_graphs(self.mode):
            return self.compiled(*args)
        leaves, spec = pytree.tree_flatten(args)
        key = (spec, tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x for x in leaves))
        entry = self.graphs.get(key)
        if entry is None:
            entry = self._capture(leaves, spec, key)
        graph, static_in, out = entry
        for dst, src in zip(static_in, leaves):
            if isinstance(src, torch.Tensor):
                dst.copy_(src, non_blocking=True)
        graph.replay()
        return out

    def _capture(self, leaves: list, spec, key):
        t0 = time.perf_counter()
        args = pytree.tree_unflatten(leaves, spec)
        if self.neutral is not None:
            args = self.neutral(*args)
        leaves = pytree.tree_flatten(args)[0]
        static_in = [x.to(self.device, copy=True) if isinstance(x, torch.Tensor) else x for x in leaves]
        args = pytree.tree_unflatten(static_in, spec)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_CALLS):
                self.compiled(*args)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.compiled(*args)
        entry = (graph, static_in, out)
        self.graphs[key] = entry
        logger.debug("captured %s for %s in %.2fs", self.name, key[1], time.perf_counter() - t0)
        return entry


class Compiler:
    """Makes `Unit`s that share a compile mode and, for CUDA graphs, one memory pool."""

    def __init__(self, mode: str, device: torch.device, world_size: int = 1):
        self.mode = resolve_compile_mode(mode, device, world_size)
        self.device = device
        self.pool = torch.cuda.graph_pool_handle() if self.uses_graphs else None

    @property
    def uses_graphs(self) -> bool:
        return uses_graphs(self.mode)

    @property
    def cpp_wrapper(self) -> bool:
        return cpp_wrapper(self.mode, self.device)

    def unit(self, fn: Callable, name: str, neutral: Optional[Callable] = None, draws: bool = False) -> Unit:
        """`draws`: every call of `fn` draws counter-based noise (a sampled step; see `Unit`'s compile options)."""
        return Unit(fn, self.mode, self.device, name, self.pool, neutral, draws)

    @property
    def any_width(self) -> bool:
        """Whether one compiled tree step serves every tree width, 1 included: eager, and inductor on the CPU, where
        `mark_width` makes the width an unbacked size. Elsewhere a width of 1 would compile a graph of its own
        (inductor specializes sizes 0 and 1 of a dimension marked dynamic; CUDA graphs capture per width)."""
        return self.mode == "off" or (self.mode == "inductor" and self.device.type == "cpu")

    def mark_width(self, width: torch.Tensor) -> None:
        """Mark a step's tree-width tensor [T] (or its drafter's beam count [k]): under inductor on the CPU as an
        unbacked size, so the graph compiled at one width runs at T = 1 too (a step that verifies its root only and
        drafts: the fixed cost of speculating, which a 2-node graph would pay one more row per request for), and at
        any beam count; elsewhere as `mark_dynamic`.

        Hinted at 1 (`WIDTH_HINT`): inductor decides at compile time whether a kernel runs in an OpenMP parallel
        region, by its size's hint, and takes an unbacked size without one for 8192. Every kernel of a tree step then
        forked and joined its threads (~1 us on 2 cores; 4-5 kernels per layer) for as little as one row of a
        128-wide model, where the AR graph's kernels ran serially; hinted, a kernel is parallel where the step's
        batch (static in a tree graph) of one-row trees has work enough for it (models/small 4 x 4: the tree steps
        6-10% cheaper against AR, docs/perf-history.md, 2026-12-02, evening)."""
        if self.any_width and "inductor" in self.mode:
            torch._dynamo.decorators.mark_unbacked(width, 0, hint_override=WIDTH_HINT)
        else:
            self.mark_dynamic(width)

    def mark_any_batch(self, slots: torch.Tensor) -> None:
        """Mark an AR step's slots [bs] under inductor on the CPU as an unbacked size (hinted at 2), so that one AR
        graph serves batch 1 too: a dynamic size would specialize 1 and compile a second graph. Its steps ran as fast
        as the two graphs' (SmolLM2 fp32, batch 1, 2 and 8, paired). Not the tree step's: with an unbacked batch its
        graph ran 3-5% slower than the batch-1 one (docs/perf-history.md, 2026-11-29, night)."""
        if self.any_width and "inductor" in self.mode:
            torch._dynamo.decorators.mark_unbacked(slots, 0, hint_override=2)
        else:
            self.mark_dynamic(slots)

    def mark_dynamic(self, *tensors: torch.Tensor) -> None:
        """Tell inductor that the first dimension of each tensor varies, so it compiles one graph for all sizes
        (CUDA graphs are still captured per size)."""
        if "inductor" in self.mode:
            for t in tensors:
                if t.shape[0] >= 2:
                    torch._dynamo.mark_dynamic(t, 0)


def _doubling(n: int) -> list[int]:
    """1, 2, 4, ... below n, and n itself."""
    out, b = [], 1
    while b < n:
        out.append(b)
        b *= 2
    return out + [n]


def batch_buckets(max_batch_size: int) -> list[int]:
    """Batch sizes CUDA graphs are captured for: powers of two up to max_batch_size, and max_batch_size itself."""
    return _doubling(max_batch_size)


def bucket_for(n: int, buckets: list[int]) -> int:
    return next(b for b in buckets if b >= n)


def beam_buckets(num_beams: int) -> list[int]:
    """Beam counts a drafting step may search: 1, 2, 4, ... and num_beams itself."""
    return _doubling(num_beams)


def depth_buckets(draft_len: int) -> list[int]:
    """Draft depths a drafting step may stop at: every one from 1 to draft_len (each reads the drafter's weights
    once more)."""
    return list(range(1, draft_len + 1))


def tree_buckets(max_tree_tokens: int) -> list[int]:
    """Tree widths a step may verify: 1 (the root: a probe), 2, 3, 5, 9, 17, ... (1 + powers of two) and the whole
    tree. Few, so that CUDA graphs capture each; spaced so that the next bucket roughly doubles the drafted nodes."""
    out, k = [1], 1
    while 1 + k < max_tree_tokens:
        out.append(1 + k)
        k *= 2
    return out + [max_tree_tokens] if max_tree_tokens > 1 else out
