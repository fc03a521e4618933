"""The step cost model the speculation policy decides by: step time by batch size and verified tree nodes, measured
on this machine for this engine, cached beside it.

    CostModel      ms per AR step and per tree step (T verified nodes, the next trees drafted), by batch bucket, at
                   two context lengths; lookups interpolate
    fingerprint    what a measurement depends on (device, dtype, kernels, linear layers, compile mode, threads, TP, the
                   kernels' sources): the cache key
    load / save    the cache file beside the engine (or the user's cache, where the engine dir is read-only)
    measure        time the engine's own decode steps on free batch slots with throw-away KV
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

import torch

from ..config import AcceptanceRule
from ..log import get_logger
from .launch import StepLauncher, StepVariant
from .state import put_rows

logger = get_logger(__name__)

COST_MODEL_FILE = "cost_model.json"
COST_MODEL_VERSION = 5  # 2: width-1 steps by beam count (`beams`, `draft`); 3: whole steps under --profile-phases;
# 4: width-1 steps by draft depth (`depths`, `by_depth`); 5: each table nondecreasing in width, beams and depth
COST_CONTEXTS = (32, 1024)  # context lengths the cost model is measured at (the longer one capped by max_seq_len)
COST_REPEATS = (3, 9)  # timed calls per measured point (after one untimed): fewest, and most for the fastest ones
COST_POINT_S = 0.25  # ... so that each point takes about this long
# a cached model whose AR or width-1 step (batch 1, the shorter context) the machine now runs in less than this share
# of its time was measured in a slow phase (a busy machine): it is measured again
STALE_RATIO = 0.7
STALE_PROBES = 5  # timed calls of each kind for that check (their median)
_MEMO_MAX = 4096  # lookups a CostModel keeps (`_cached`) before it starts its memo afresh


@dataclass
class CostModel:
    """Measured step times (ms): `ar[b]` and `tree[b][T]` at context lengths `contexts` (two), for the batch sizes
    `batches` (the engine's buckets); `tree` drafts the next trees with every beam, and `draft[b][k]` is a width-1
    step that drafts with `beams[k]` beams (empty where the step drafts one count only), `by_depth[b][d]` one that
    drafts every beam to depth `depths[d]` (empty where the step drafts one depth only). Lookups interpolate linearly
    between measured batch sizes and contexts (and extrapolate past the longer context)."""

    batches: list[int]
    widths: list[int]
    contexts: list[int]
    ar: list[list[float]]  # [context][batch]
    tree: list[list[list[float]]]  # [context][batch][width]
    key: dict = field(default_factory=dict)  # what it was measured for (`fingerprint`)
    beams: list[int] = field(default_factory=list)  # beam counts measured, ascending, every beam last
    draft: list[list[list[float]]] = field(default_factory=list)  # [context][batch][beam count]
    depths: list[int] = field(default_factory=list)  # draft depths measured, ascending, the whole depth last
    by_depth: list[list[list[float]]] = field(default_factory=list)  # [context][batch][depth]

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        if not name.startswith("_"):  # a table replaced (a test scales one): what was looked up in it goes
            self.__dict__.pop("_memo", None)

    def ar_ms(self, batch: int, context: float) -> float:
        return self._cached(("ar",), batch, context)

    def tree_ms(self, batch: int, width: int, context: float, beams: int = 0, depth: int = 0) -> float:
        """A tree step verifying `width` nodes and drafting the next trees with `beams` beams (0: every beam) to
        `depth` tokens (0: the whole depth): the measured step at that width, less what drafting less deep saves at
        width 1 and what drafting fewer beams saves there (each measured with the other whole). Fewer beams save at
        each drafting step, so their saving shrinks with the depth drafted: depth / dl of the whole depth's.
        Each saving is at most its share of the fixed cost (the width-1 step less the AR step, all of it taken for
        drafting): (dl - depth) / dl of it, and (nb - beams) / nb of what is left. A busy host timed a depth-1 step
        far below the whole one, and the step came out no dearer than an AR step: drafting looked free."""
        return self.tree_ms_at(batch, (width,), context, beams, depth)[0]

    def tree_ms_at(self, batch: int, widths: Iterable[int], context: float, beams: int = 0, depth: int = 0
                   ) -> list[float]:
        """`tree_ms` at each of `widths`: what drafting fewer beams or less deep saves is the same at every width,
        so it is looked up once (the policy weighs every width for each beam count and depth it considers)."""
        rows = [self._cached(("tree", self.widths.index(w)), batch, context) for w in widths]
        less_deep_share = _share(self.depths, depth)
        if not less_deep_share and not _share(self.beams, beams):
            return rows
        width1 = self._cached(("tree", 0), batch, context)
        fixed = max(width1 - self.ar_ms(batch, context), 0.0)
        less_deep = self._saving("by_depth", self.depths, depth, batch, context, fixed)
        fewer_beams = self._saving("draft", self.beams, beams, batch, context, fixed)
        few = fewer_beams * (1 - less_deep_share)  # fewer beams save at each depth drafted
        return [ms - less_deep - few for ms in rows]

    def _saving(self, steps: str, options: list[int], value: int, batch: int, context: float, fixed: float) -> float:
        """What a width-1 step drafting `value` (a beam count or depth; 0: the whole) saves against one drafting the
        whole, from the table `steps` names ([context][batch][option]) measured at `options` (none: nothing known,
        nothing saved); at most its share of the `fixed` cost (`_share`)."""
        share = _share(options, value)
        if not share:
            return 0.0
        measured = self._cached((steps, options.index(value)), batch, context)
        return min(measured, fixed * share)

    def _cached(self, column: tuple, batch: int, context: float) -> float:
        """`_lookup` of one column of the tables, memoized: the policy asks for the same few columns at the step's
        batch size and context once per width, beam count and depth it weighs (hundreds of lookups a step, each of
        which built its column anew). `column`: ("ar",), ("tree", width index), or ("by_depth" | "draft", option
        index): that option's saving against the last (the whole depth or every beam). The tables are never changed
        in place; setting one clears the memo (`__setattr__`)."""
        memo = self.__dict__.get("_memo")
        if memo is None or len(memo) > _MEMO_MAX:
            memo = self.__dict__["_memo"] = {}
        key = (column, batch, context)
        ms = memo.get(key)
        if ms is None:
            table = memo.get(column)
            if table is None:
                kind = column[0]
                if kind == "ar":
                    table = self.ar
                elif kind == "tree":
                    table = [[per_b[column[1]] for per_b in row] for row in self.tree]
                else:
                    table = [[per_b[-1] - per_b[column[1]] for per_b in row] for row in getattr(self, kind)]
                memo[column] = table
            ms = memo[key] = self._lookup(table, batch, context)
        return ms

    def outpaced_by(self, ar_ms: float, width1_ms: float) -> bool:
        """Whether steps timed now (batch 1, the shorter context) ran in under STALE_RATIO of this model's cells:
        a model measured in a slow phase. A slow phase now never makes a model stale."""
        return ar_ms < STALE_RATIO * self.ar[0][0] or width1_ms < STALE_RATIO * self.tree[0][0][0]

    def _lookup(self, table: list[list[float]], batch: int, context: float) -> float:
        at_ctx = [_interp(self.batches, row, batch) for row in table]
        (c0, c1), (v0, v1) = self.contexts, at_ctx
        return max(v0 + (v1 - v0) * (context - c0) / (c1 - c0), min(v0, v1) * 0.5)

    def to_dict(self) -> dict:
        return {"batches": self.batches, "widths": self.widths, "contexts": self.contexts, "ar": self.ar,
                "tree": self.tree, "key": self.key, "beams": self.beams, "draft": self.draft, "depths": self.depths,
                "by_depth": self.by_depth}

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        return cls(d["batches"], d["widths"], d["contexts"], d["ar"], d["tree"], d.get("key", {}), d.get("beams", []),
                   d.get("draft", []), d.get("depths", []), d.get("by_depth", []))

    def overheads(self) -> list[dict]:
        """What speculating costs, per context and batch: `fixed`, a width-1 tree step (it verifies the root only and
        drafts the next trees) over an AR step, the price of speculating before a single draft is verified; and
        `per_node_ms`, what each further verified node adds (the least-squares slope of step time over the widths
        from 2 up), also in AR steps (`per_node`)."""
        out = []
        for c, ctx in enumerate(self.contexts):
            for b, bs in enumerate(self.batches):
                ar, tree = self.ar[c][b], self.tree[c][b]
                pts = [(w, t) for w, t in zip(self.widths, tree) if w >= 2]
                slope = 0.0
                if len(pts) >= 2:
                    mw = sum(w for w, _ in pts) / len(pts)
                    mt = sum(t for _, t in pts) / len(pts)
                    slope = sum((w - mw) * (t - mt) for w, t in pts) / sum((w - mw) ** 2 for w, _ in pts)
                row = {"context": ctx, "batch": bs, "ar_ms": ar, "width1_ms": tree[0], "fixed": tree[0] / ar,
                       "per_node_ms": slope, "per_node": slope / ar}
                if self.beams:  # a width-1 step drafting one beam: speculating at its cheapest
                    row.update(width1_one_beam_ms=self.draft[c][b][0], fixed_one_beam=self.draft[c][b][0] / ar)
                if self.depths:  # ... drafting one token deep
                    row.update(width1_depth1_ms=self.by_depth[c][b][0], fixed_depth1=self.by_depth[c][b][0] / ar)
                out.append(row)
        return out

    def overhead_table(self) -> str:
        one, shallow = bool(self.beams), bool(self.depths)
        lines = ["| context | batch | AR step ms | width-1 tree step ms | fixed cost (width 1 / AR) | "
                 + ("fixed, drafting 1 beam | " if one else "") + ("fixed, drafting depth 1 | " if shallow else "")
                 + "per verified node ms | per node / AR |",
                 "|---|---|---|---|---|---|---|" + ("---|" if one else "") + ("---|" if shallow else "")]
        for o in self.overheads():
            lines.append(f"| {o['context']} | {o['batch']} | {o['ar_ms']:.2f} | {o['width1_ms']:.2f} | "
                         f"{o['fixed']:.2f} | " + (f"{o['fixed_one_beam']:.2f} | " if one else "") +
                         (f"{o['fixed_depth1']:.2f} | " if shallow else "") +
                         f"{o['per_node_ms']:.3f} | {o['per_node']:.3f} |")
        return "\n".join(lines)

    def table(self) -> str:
        """The measurement as a markdown table: ms per step by batch and width, at each context."""
        lines = []
        for c, ctx in enumerate(self.contexts):
            lines.append(f"step ms at context {ctx}: | batch | AR | " + " | ".join(f"T={w}" for w in self.widths) +
                         " |")
            for b, bs in enumerate(self.batches):
                lines.append(f"| {bs} | {self.ar[c][b]:.2f} | " +
                             " | ".join(f"{x:.2f}" for x in self.tree[c][b]) + " |")
            if self.beams:
                lines.append(f"width-1 step ms by beams drafted at context {ctx}: | batch | " +
                             " | ".join(f"{k} beam{'s' if k > 1 else ''}" for k in self.beams) + " |")
                for b, bs in enumerate(self.batches):
                    lines.append(f"| {bs} | " + " | ".join(f"{x:.2f}" for x in self.draft[c][b]) + " |")
            if self.depths:
                lines.append(f"width-1 step ms by draft depth at context {ctx}: | batch | " +
                             " | ".join(f"depth {d}" for d in self.depths) + " |")
                for b, bs in enumerate(self.batches):
                    lines.append(f"| {bs} | " + " | ".join(f"{x:.2f}" for x in self.by_depth[c][b]) + " |")
        return "\n".join(lines)


def _interp(xs: list[int], ys: list[float], x: float) -> float:
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1] * x / xs[-1]  # past the largest measured batch: proportional (compute-bound)
    i = bisect.bisect_left(xs, x)
    if xs[i] == x:
        return ys[i]
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


CODE_KEYS = ("version", "torch", "kernel_sources")  # the fingerprint's parts that name the code that measured it


def fingerprint(**parts) -> dict:
    """What a cost model depends on besides the engine's weights: the machine, how the engine runs, and the sources
    of the step's own kernels (a changed kernel changes the step's costs). `CODE_KEYS` names the parts that say which
    code measured it (a save drops other code's entries)."""
    device = parts.pop("device")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = _cpu_name()
        # the CPU kernels' weight prefetch distance where it is not the default (another distance, other step costs)
        from .. import cpu

        ahead = cpu.loaded_prefetch_bytes()
        if ahead is not None and ahead != cpu.DEFAULT_PREFETCH_BYTES:
            parts["cpu_prefetch"] = ahead
    return {"version": COST_MODEL_VERSION, "device": name, "torch": torch.__version__,
            "kernel_sources": kernel_sources_digest(), **parts}


def kernel_sources_digest(roots: Optional[Iterable[Path]] = None) -> str:
    """A digest of the step kernels' sources: the CPU kernels (cpu/*.cpp, *.h), the Triton kernels (plugins/*.py)
    and the compile options (runtime/graphs.py) of this installed copy."""
    pkg = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    files = [] if roots else [Path(__file__).with_name("graphs.py")]
    for root in roots or (pkg / "cpu", pkg / "plugins"):
        files += sorted(p for ext in ("*.cpp", "*.h", "*.py") for p in Path(root).glob(ext))
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _cpu_name() -> str:
    from .. import cpu

    return f"{cpu.model_name()} x{os.cpu_count()}"


def cost_cache_paths(engine_dir: Optional[Path]) -> list[Path]:
    """Where a cost model is looked up and written: beside the engine, else the user's cache (an engine directory
    may be read-only, e.g. mounted into a container)."""
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trt-redrafter" / "cost-models"
    out = []
    if engine_dir is not None:
        out.append(engine_dir / COST_MODEL_FILE)
        ident = hashlib.sha256(str(engine_dir.resolve()).encode()).hexdigest()[:16]
        out.append(home / f"{ident}.json")
    return out


def _key_id(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def load_cost_model(paths: Iterable[Path], key: dict) -> Optional[CostModel]:
    kid = _key_id(key)
    for path in paths:
        try:
            entries = json.loads(path.read_text()).get("entries", {})
        except (OSError, ValueError, AttributeError):
            continue
        if kid in entries:
            try:
                return CostModel.from_dict(entries[kid])
            except (KeyError, TypeError):
                continue
    return None


def save_cost_model(paths: Iterable[Path], model: CostModel) -> Optional[Path]:
    """Add `model` to the first writable cache file (written under a temporary name, then renamed), dropping the
    entries that other code measured (another cost-model version, PyTorch or kernel sources: `CODE_KEYS`), which
    this install can never look up again; other machines' and settings' entries stay."""
    kid = _key_id(model.key)
    for path in paths:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                doc = json.loads(path.read_text())
                if not isinstance(doc.get("entries"), dict):
                    raise ValueError
            except (OSError, ValueError, AttributeError):
                doc = {"entries": {}}
            code = {k: model.key.get(k) for k in CODE_KEYS}
            doc["entries"] = {k: e for k, e in doc["entries"].items()
                              if isinstance(e, dict) and {c: e.get("key", {}).get(c) for c in CODE_KEYS} == code}
            doc["entries"][kid] = model.to_dict()
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(doc, indent=1))
            tmp.replace(path)
            return path
        except OSError:
            continue
    return None



# ---- measuring ----------------------------------------------------------------------------------------------------

def load_or_measure(launcher: StepLauncher, dist, engine_dir: Optional[Path], key: dict, free: list[int],
                    max_seq_len: int, draft: bool) -> CostModel:
    """The cost model for `key`: from the cache beside the engine (or the user's cache) when one was measured for this
    machine and these settings and the machine does not now run its steps much faster (a model measured while the
    machine was busy: `CostModel.outpaced_by`), else measured now (every rank takes part: the steps are collective)
    and saved."""
    with launcher.timer.paused():  # fused steps, as every run takes them, with or without --profile-phases
        return _load_or_measure(launcher, dist, engine_dir, key, free, max_seq_len, draft)


def _load_or_measure(launcher: StepLauncher, dist, engine_dir: Optional[Path], key: dict, free: list[int],
                     max_seq_len: int, draft: bool) -> CostModel:
    paths = cost_cache_paths(engine_dir)
    model = load_cost_model(paths, key) if dist.is_driver else None
    if dist.broadcast_object(model is not None):
        now = probe_steps(launcher, free, max_seq_len, draft)
        slow = dist.broadcast_object(model is not None and model.outpaced_by(*now))
        if not slow:
            return model
        if dist.is_driver:
            logger.info("the cached step cost model is slower than this machine now (AR %.2f ms against %.2f, width "
                        "1 %.2f against %.2f: measured while the machine was busy?); measuring it again",
                        now[0], model.ar[0][0], now[1], model.tree[0][0][0])
    model = measure(launcher, dist, free, max_seq_len, draft)
    model.key = key
    if dist.is_driver:
        where = save_cost_model(paths, model)
        logger.info("step cost model measured and saved to %s", where or "(nowhere writable)")
    return model


@torch.inference_mode()  # the step's static inputs (CUDA graphs) are inference tensors made in the warm-up
def measure(launcher: StepLauncher, dist, free_slots: list[int], max_seq_len: int, draft: bool) -> CostModel:
    """Time the decode steps on this machine: an AR step, and a tree step (verifying T nodes, drafting the next trees
    where `draft`) at every tree width, for every batch bucket that fits the free slots, at two context lengths
    (COST_CONTEXTS). Runs on free batch slots with throw-away KV; a width that could not pay even if every node were
    accepted (its step costs more than 1 + dl AR steps) ends the widths of that batch size (the rest are
    extrapolated, proportionally). The calls of one point are timed in interleaved rounds, so that the machine's
    slow phases do not bias the ratios between them. Under TP every rank takes part (the steps are collective) and
    rank 0's timings decide how many steps run."""
    from tqdm import tqdm

    t0 = time.perf_counter()
    tree = launcher.tree_shape
    P, dl = tree.max_tree_tokens, tree.draft_len_per_beam
    contexts = _contexts(launcher, max_seq_len)
    batches = [b for b in launcher.buckets if b <= len(free_slots)]
    free = sorted(free_slots)[:batches[-1]]
    ids = _scratch(launcher, free, contexts[1] + P)
    variant = StepVariant(True, AcceptanceRule.GREEDY, draft)
    once = functools.partial(_once, launcher)

    def timed(calls: list, slots: list[int], ctx: int) -> list[float]:
        """Median ms of each call, timed in rounds of one call each: a slow phase of the machine (a shared host's
        bandwidth moves for seconds at a time) then slows every call of a point alike, and the ratios the policy
        decides by stay put. One untimed round first; rank 0's timings set the number of rounds (every step is
        collective)."""
        times: list[list[float]] = [[] for _ in calls]
        rounds, r = COST_REPEATS[0], 0
        while r < rounds + 1:
            for i, call in enumerate(calls):
                times[i].append(once(call, slots, ctx))
            if r == 1:
                per_round = sum(t[1] for t in times)
                rounds = dist.broadcast_object(
                    max(COST_REPEATS[0], min(COST_REPEATS[1], int(COST_POINT_S * len(calls) / per_round))))
            r += 1
        return [1e3 * statistics.median(t[1:]) for t in times]

    # untimed first: the first steps after loading fault the weights in and build lazily made things
    for _ in range(3):
        launcher.ar(free[:1], contexts[0] + 1, AcceptanceRule.GREEDY).cpu()
        launcher.tree(free[:1], P, [P], contexts[0], variant).cpu()

    widths = launcher.widths
    beams = launcher.beam_options if draft and len(launcher.beam_options) > 1 else []
    depths = launcher.depth_options if draft and len(launcher.depth_options) > 1 else []
    ar = [[0.0] * len(batches) for _ in contexts]
    trees = [[[0.0] * len(widths) for _ in batches] for _ in contexts]
    drafts = [[[0.0] * len(beams) for _ in batches] for _ in contexts]
    by_depth = [[[0.0] * len(depths) for _ in batches] for _ in contexts]
    grid = [(c, b) for c in range(len(contexts)) for b in range(len(batches))]
    for c, b in tqdm(grid, desc="measuring step costs", unit="point", disable=not dist.is_driver or None,
                     leave=False):
        ctx, bs = contexts[c], batches[b]
        slots = free[:bs]
        calls = [lambda: launcher.ar(slots, ctx + 1, AcceptanceRule.GREEDY)]

        def probe(call) -> float:  # the faster of two calls after an untimed one (which may still build things):
            once(call, slots, ctx)  # one call alone may fall on a stall, and a width cut wrongly is extrapolated
            return min(once(call, slots, ctx) for _ in range(2))

        # widths in order, probed, until one could not pay even if all its nodes were accepted; the rounds below time
        # the AR step and the widths up to that one
        ar_probe = probe(calls[0])
        for T in widths:
            calls.append(lambda T=T: launcher.tree(slots, T, [T] * bs, ctx, variant))
            if dist.broadcast_object(probe(calls[-1]) > (1 + dl) * ar_probe):
                break
        n = len(calls) - 1
        # width-1 steps drafting fewer beams, in the same rounds (the last count is every beam: the T=1 call)
        calls += [lambda k=k: launcher.tree(slots, 1, [1] * bs, ctx, variant, beams=k) for k in beams[:-1]]
        # ... and drafting every beam less deep (the last depth is the whole one: the T=1 call)
        calls += [lambda d=d: launcher.tree(slots, 1, [1] * bs, ctx, variant, depth=d) for d in depths[:-1]]
        ms = timed(calls, slots, ctx)
        ar[c][b] = ms[0]
        for w, T in enumerate(widths):  # the widths past the cut-off extrapolated, proportionally
            trees[c][b][w] = ms[1 + w] if w < n else ms[n] * T / widths[n - 1]
        nk = max(len(beams) - 1, 0)
        if beams:
            drafts[c][b] = ms[1 + n:1 + n + nk] + [ms[1]]
        if depths:
            by_depth[c][b] = ms[1 + n + nk:] + [ms[1]]
        # verifying more nodes, or drafting more beams or deeper, never costs less: a cell timed below a smaller
        # option's is the machine's noise (a busy host timed a tiny engine's width 2-5 steps below its width 1), and
        # the policy would take the wider step for free. Each row is fitted nondecreasing (pooled adjacent violators)
        trees[c][b], drafts[c][b], by_depth[c][b] = (_nondecreasing(r) for r in (trees[c][b], drafts[c][b],
                                                                                   by_depth[c][b]))
    _release(launcher, ids, free)
    model = CostModel(batches, list(widths), contexts, ar, trees, beams=list(beams), draft=drafts if beams else [],
                      depths=list(depths), by_depth=by_depth if depths else [])
    logger.info("step costs measured in %.1fs (%d batch sizes x %d tree widths x %d contexts)",
                time.perf_counter() - t0, len(batches), len(widths), len(contexts))
    return model


def _share(options: list[int], value: int) -> float:
    """The share of the drafting that drafting `value` of the whole (options[-1]: beams or depth) leaves out; 0 for
    the whole, for a value of 0 (the whole, unspecified) and where no options were measured."""
    if not value or not options:
        return 0.0
    return 1 - value / options[-1]


def _nondecreasing(xs: list[float]) -> list[float]:
    """The least-squares nondecreasing fit of `xs` (pool adjacent violators: a run that decreases becomes its mean)."""
    blocks: list[list[float]] = []  # [sum, count]
    for x in xs:
        blocks.append([x, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


def _contexts(launcher: StepLauncher, max_seq_len: int) -> list[int]:
    """The two context lengths a model is measured at (COST_CONTEXTS, the longer capped by the engine's length)."""
    hi = max(COST_CONTEXTS[0] + 1, min(COST_CONTEXTS[1], max_seq_len - launcher.tree_shape.max_tree_tokens - 1))
    return [min(COST_CONTEXTS[0], hi - 1), hi]


def _scratch(launcher: StepLauncher, slots: list[int], tokens: int) -> list[int]:
    """Throw-away sequences of `tokens` KV positions bound to `slots` -> their ids (real ones count from 0)."""
    ids = [-1 - i for i in range(len(slots))]
    for sid, slot in zip(ids, slots):
        launcher.cache.reserve(sid, tokens)
        launcher.cache.bind(sid, slot)
    launcher.cache.sync()
    return ids


def _release(launcher: StepLauncher, ids: list[int], slots: list[int]) -> None:
    for sid in ids:
        launcher.cache.free(sid)
    idx = torch.tensor(slots, device=launcher.device)
    put_rows(launcher.state.ctx_len, idx, torch.zeros_like(idx))


def _once(launcher: StepLauncher, call, slots: list[int], ctx: int) -> float:
    """Seconds of one step `call()` on `slots` at context `ctx` (its result read back)."""
    idx = torch.tensor(slots, device=launcher.device)
    put_rows(launcher.state.ctx_len, idx, torch.full_like(idx, ctx))
    t = time.perf_counter()
    call().cpu()
    return time.perf_counter() - t


@torch.inference_mode()
def probe_steps(launcher: StepLauncher, free_slots: list[int], max_seq_len: int, draft: bool) -> tuple[float, float]:
    """The median of STALE_PROBES AR steps and of as many width-1 tree steps (drafting where `draft`), alternating,
    after one untimed call of each, batch 1 at the shorter of the model's contexts, in ms: what
    `CostModel.outpaced_by` checks a cached model with (every rank calls it: the steps are collective)."""
    slot = sorted(free_slots)[:1]
    ctx, hi = _contexts(launcher, max_seq_len)
    ids = _scratch(launcher, slot, hi + launcher.tree_shape.max_tree_tokens)
    variant = StepVariant(True, AcceptanceRule.GREEDY, draft)
    calls = [lambda: launcher.ar(slot, ctx + 1, AcceptanceRule.GREEDY),
             lambda: launcher.tree(slot, 1, [1], ctx, variant)]
    try:
        times = [[_once(launcher, call, slot, ctx) for call in calls] for _ in range(STALE_PROBES + 1)][1:]
    finally:
        _release(launcher, ids, slot)
    return tuple(1e3 * statistics.median(t[i] for t in times) for i in range(len(calls)))
