"""The CI perf gate: a results document against a committed baseline, with rules that survive noisy machines.

Absolute ms/token moves with the machine (another job on the runner, a different CPU, clocks), so nothing
absolute is gated. Per (TP, QPS) point:

    speedup          AR TPOT / ReDrafter TPOT, both from the same results run (median over repeats of the ratio
                     taken within each repeat), may not fall more than `speedup_margin` (relative) below the
                     baseline's. Drift of the machine divides out; a slower ReDrafter path does not.
    tokens_per_step  greedy acceptance length per mode, deterministic for fixed prompts, engine and max_tokens:
                     within `tokens_per_step_tolerance` (relative) of the baseline. A drafter, acceptance or
                     engine-config regression shows up here whatever the timing noise.
    errors           failed requests (all modes, all repeats) at most `max_errors` (0).
And, where the baseline has the engine's speculation overheads (`bench-engine`'s `speculation_overheads`, kept by
`gate --update-baseline --engine-results` per kernel set, `bench-engine`'s `kernels`: a CPU without AVX-512 runs
torch's ops, whose fixed cost is its own), once per engine document:
    fixed_cost       the width-1 tree step over the AR step in the engine's step cost model (what speculating costs
                     before a single draft is verified), at the shortest measured context and batch 1 (the larger
                     batches' ratio swung by a quarter between runs here): at most `fixed_cost_margin` (relative)
                     above the baseline's. A ratio of two steps timed
                     in interleaved rounds: the machine's speed divides out; a dearer draft, accept or pack does not.

A point of the baseline missing from the results fails. Results measured with a different bench config
(max_tokens, dataset, ...) are not comparable: that is bad input (UserError), not a regression.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Optional

from ..config import ConfigBase, bad_value, option
from ..errors import UserError

# bench config keys that must match for two documents to be comparable (the dataset by its prompts' hash, not path)
COMPARABLE_KEYS = ("chat_template", "max_tokens", "ignore_eos", "temperature", "num_requests", "warmup",
                   "seed", "repeats")
ENGINE_KEYS = ("backend", "tp", "num_beams", "draft_len_per_beam", "greedy_search", "dtype", "max_batch_size")


@dataclass
class GateConfig(ConfigBase):
    """Gate thresholds (ci/perf_gate.yaml, section `gate`)."""

    SECTION: ClassVar[str] = "gate"

    speedup_margin: float = option(0.10, help="allowed relative drop of the AR/ReDrafter speedup below the baseline")
    tokens_per_step_tolerance: float = option(0.01, help="allowed relative change of greedy tokens/step")
    max_errors: int = option(0, help="failed requests allowed per (TP, QPS) point")
    fixed_cost_margin: float = option(0.25, help="allowed relative rise of the fixed cost of speculating (width-1 "
                                                 "tree step / AR step) above the baseline's")

    def validate(self) -> None:
        super().validate()
        s = self.SECTION
        if not 0 <= self.speedup_margin < 1:
            raise bad_value(s, "speedup_margin", "a fraction in [0, 1)", self.speedup_margin)
        if not 0 <= self.tokens_per_step_tolerance < 1:
            raise bad_value(s, "tokens_per_step_tolerance", "a fraction in [0, 1)", self.tokens_per_step_tolerance)
        if self.max_errors < 0:
            raise bad_value(s, "max_errors", "a non-negative integer", self.max_errors)
        if not 0 <= self.fixed_cost_margin < 1:
            raise bad_value(s, "fixed_cost_margin", "a fraction in [0, 1)", self.fixed_cost_margin)


@dataclass
class Check:
    rule: str
    point: str  # "tp1 qps1" (+ mode)
    passed: bool
    value: Optional[float] = None
    baseline: Optional[float] = None
    allowed: str = ""
    why: str = ""

    def line(self) -> str:
        v = lambda x: "-" if x is None else f"{x:.4g}"  # noqa: E731
        return (f"{'PASS' if self.passed else 'FAIL'}  {self.rule:<16} {self.point:<22} value {v(self.value):>8}  "
                f"baseline {v(self.baseline):>8}  allowed {self.allowed:<16} {self.why}")


@dataclass
class GateReport:
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def text(self) -> str:
        lines = [c.line() for c in self.checks] + [f"note: {n}" for n in self.notes]
        failed = [c for c in self.checks if not c.passed]
        lines.append(f"gate {'PASSED' if not failed else 'FAILED'}: {len(self.checks) - len(failed)}/{len(self.checks)} "
                     f"checks pass" + (f"; failing: {', '.join(sorted({c.rule for c in failed}))}" if failed else ""))
        return "\n".join(lines)


def _label(tp: int, qps: float, mode: str = "") -> str:
    return f"tp{tp} qps{qps:g}" + (f" {mode}" if mode else "")


def check_comparable(baseline: dict, results: dict) -> None:
    b, r = baseline["config"], results["config"]
    diffs = [f"{k}: baseline {b.get(k)!r}, results {r.get(k)!r}" for k in COMPARABLE_KEYS if b.get(k) != r.get(k)]
    bp, rp = (baseline.get("prompts") or {}).get("sha256"), (results.get("prompts") or {}).get("sha256")
    if bp and rp and bp != rp:
        diffs.append(f"prompts: the usable prompt set differs (sha256 {bp[:12]} vs {rp[:12]}; dataset "
                     f"{b.get('dataset')!r} vs {r.get('dataset')!r})")
    be = sorted(tuple(e.get(k) for k in ENGINE_KEYS) for e in baseline.get("engines", {}).values())
    re_ = sorted(tuple(e.get(k) for k in ENGINE_KEYS) for e in results.get("engines", {}).values())
    if be and re_ and be != re_:
        diffs.append(f"engines ({', '.join(ENGINE_KEYS)}): baseline {be}, results {re_}")
    if diffs:
        raise UserError("the results were not measured like the baseline, so they are not comparable ("
                        + "; ".join(diffs) + "); re-run the bench with the baseline's settings, or accept the new "
                        "setup with --update-baseline.")


def gated_overheads(overheads: list[dict]) -> list[dict]:
    """The fixed-cost points the gate checks: batch 1 at the shortest context."""
    if not overheads:
        return []
    ctx = min(o["context"] for o in overheads)
    return [o for o in overheads if o["context"] == ctx and o["batch"] == 1]


def baseline_overheads(baseline: dict) -> dict[str, list[dict]]:
    """The baseline's speculation overheads per kernel set they were measured with (`bench-engine`'s `kernels`:
    "cpu", "torch", "triton"). A baseline from before they were kept per kernel set has one list, for any: key "*"."""
    by = baseline.get("speculation_overheads_by_kernels")
    if by:
        return dict(by)
    old = baseline.get("speculation_overheads")
    return {"*": old} if old else {}


def with_overheads(baseline: Optional[dict], new: dict, engine_doc: dict) -> dict:
    """`new` (a baseline being written) with `engine_doc`'s speculation overheads under its kernel set, beside the
    other kernel sets' from the old `baseline` (other machines: each keeps its own)."""
    kept = {k: v for k, v in (baseline_overheads(baseline) if baseline else {}).items() if k != "*"}
    kept[engine_doc.get("kernels") or "*"] = engine_doc["speculation_overheads"]
    return {**new, "speculation_overheads_by_kernels": dict(sorted(kept.items()))}


def _fixed_cost_checks(baseline: dict, engine_doc: Optional[dict], cfg: GateConfig, rep: GateReport) -> None:
    by_kernels = baseline_overheads(baseline)
    if not by_kernels:
        if engine_doc is not None:
            rep.notes.append("the baseline has no speculation overheads: the fixed cost is not gated (refresh it with "
                             "--update-baseline --engine-results)")
        return
    if engine_doc is None:
        raise UserError("the baseline gates the fixed cost of speculating: pass the engine benchmark's document with "
                        "--engine-results (ci/smoke.sh writes it with trt-redrafter bench-engine).")
    kernels = engine_doc.get("kernels")
    # a step's fixed cost is a property of the kernels that run it (this project's AVX-512 kernels, or torch's ops
    # where the CPU has no AVX-512): a machine is held to the baseline of its own kernel set
    base_rows = gated_overheads(by_kernels.get(kernels) or by_kernels.get("*") or [])
    if not base_rows:
        rep.notes.append(f"the baseline has no speculation overheads measured with this engine's kernels "
                         f"({kernels!r}; it has {', '.join(map(repr, sorted(by_kernels)))}): the fixed cost is not "
                         f"gated here (add them with --update-baseline --engine-results on such a machine)")
        return
    got = {(o["context"], o["batch"]): o for o in engine_doc.get("speculation_overheads") or []}
    for b in base_rows:
        label = f"context {b['context']} batch {b['batch']}" + (f" ({kernels} kernels)" if kernels else "")
        ceiling = b["fixed"] * (1 + cfg.fixed_cost_margin)
        r = got.get((b["context"], b["batch"]))
        if r is None:
            rep.checks.append(Check("fixed_cost", label, False, None, b["fixed"], f"<= {ceiling:.4g}",
                                    "no such point in the engine benchmark's cost model"))
            continue
        ok = r["fixed"] <= ceiling
        why = f"{r['fixed'] / b['fixed'] - 1:+.1%} vs baseline (margin +{cfg.fixed_cost_margin:.0%})"
        rep.checks.append(Check("fixed_cost", label, ok, r["fixed"], b["fixed"], f"<= {ceiling:.4g}",
                                why if ok else "speculating got dearer before any draft is verified: " + why))


def evaluate(baseline: dict, results: dict, cfg: GateConfig, engine_doc: Optional[dict] = None) -> GateReport:
    """Every rule at every (TP, QPS) point of the baseline; the fixed cost of speculating from `engine_doc`
    (a bench-engine document) where the baseline has it."""
    check_comparable(baseline, results)
    rep = GateReport()
    _fixed_cost_checks(baseline, engine_doc, cfg, rep)
    greedy = not results["config"].get("temperature")
    # the gated speedup is ReDrafter's (documents before the N-gram modes have no `mode`: all ReDrafter)
    r_speed = {(s["tp"], s["qps"]): s for s in results["speedups"] if s.get("mode", "redrafter") == "redrafter"}
    r_points = {(p["tp"], p["qps"], p["mode"]): p for p in results["points"]}
    b_points = {(p["tp"], p["qps"], p["mode"]): p for p in baseline["points"]}
    keys = sorted({(tp, qps) for tp, qps, _ in b_points})
    for tp, qps in keys:
        # speedup
        b = next((s for s in baseline["speedups"]
                  if (s["tp"], s["qps"]) == (tp, qps) and s.get("mode", "redrafter") == "redrafter"), None)
        if b is not None and b.get("speedup") is not None:
            base = b["speedup"]
            floor = base * (1 - cfg.speedup_margin)
            s = r_speed.get((tp, qps))
            val = None if s is None else s.get("speedup")
            if val is None:
                rep.checks.append(Check("speedup", _label(tp, qps), False, None, base, f">= {floor:.4g}",
                                        "no AR/ReDrafter speedup at this point in the results"))
            else:
                rel = val / base - 1
                ok = val >= floor
                why = (f"{rel:+.1%} vs baseline (margin -{cfg.speedup_margin:.0%}); repeats {_fmt_list(s.get('per_repeat'))}")
                if not ok:
                    why = "ReDrafter lost speedup over AR: " + why
                elif rel > cfg.speedup_margin:
                    rep.notes.append(f"speedup at {_label(tp, qps)} improved {rel:+.1%} beyond the margin; "
                                     f"refresh the baseline on purpose (--update-baseline) to lock it in")
                rep.checks.append(Check("speedup", _label(tp, qps), ok, val, base, f">= {floor:.4g}", why))
        # tokens/step, per mode
        for mode in ("ar", "redrafter"):
            bp = b_points.get((tp, qps, mode))
            if bp is None:
                continue
            base = bp["metrics"].get("tokens_per_step")
            rp = r_points.get((tp, qps, mode))
            if rp is None:
                rep.checks.append(Check("tokens_per_step", _label(tp, qps, mode), False, None, base, "",
                                        "point missing from the results"))
                continue
            if not greedy or base is None:
                continue  # sampled acceptance is random; only greedy tokens/step is deterministic enough to gate
            val = rp["metrics"].get("tokens_per_step")
            tol = cfg.tokens_per_step_tolerance * base
            ok = val is not None and abs(val - base) <= tol
            why = ("no tokens/step in the results" if val is None else
                   f"{val / base - 1:+.2%} vs baseline (tolerance {cfg.tokens_per_step_tolerance:.0%})")
            if not ok and val is not None:
                why = ("acceptance dropped (drafter, acceptance or engine config changed?): " if val < base else
                       "acceptance rose: if intended, refresh the baseline: ") + why
            rep.checks.append(Check("tokens_per_step", _label(tp, qps, mode), ok, val, base,
                                    f"{base - tol:.4g}..{base + tol:.4g}", why))
        # errors over every mode and repeat at this point
        errs = [r_points[k]["metrics"]["errors"] for k in r_points if k[:2] == (tp, qps)]
        n = sum(errs) if errs else None
        ok = n is not None and n <= cfg.max_errors
        samples = sorted({e for k in r_points if k[:2] == (tp, qps) for e in r_points[k]["metrics"]["error_samples"]})
        why = ("point missing from the results" if n is None else
               f"{n} failed request(s): {'; '.join(samples)[:200]}" if n else "no failed requests")
        rep.checks.append(Check("errors", _label(tp, qps), ok, n, 0, f"<= {cfg.max_errors}", why))
    extra = sorted({(tp, qps) for tp, qps, _ in r_points} - set(keys))
    if extra:
        rep.notes.append(f"results have points the baseline lacks (not gated): "
                         f"{', '.join(_label(tp, qps) for tp, qps in extra)}")
    return rep


def _fmt_list(xs) -> str:
    return "[" + ", ".join(f"{x:.3f}" for x in xs) + "]" if xs else "[]"


def load_gate_config(path: Optional[str | Path]) -> GateConfig:
    """Thresholds from a YAML file's `gate:` section (defaults without a file)."""
    if path is None:
        return GateConfig()
    return GateConfig.from_sources(load_yaml_sections(path, (GateConfig.SECTION,)), None)


def load_yaml_sections(path: str | Path, sections: tuple[str, ...]) -> dict:
    import yaml

    path = Path(path)
    if not path.is_file():
        raise UserError(f"config {path} does not exist.")
    try:
        d = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise UserError(f"config {path} is not valid YAML: {e}") from e
    if not isinstance(d, dict) or set(d) - set(sections):
        raise UserError(f"config {path} must be a mapping with only the section(s) {', '.join(sections)}.")
    return d
