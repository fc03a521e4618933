"""The offline engine benchmark (`trt-redrafter bench-engine`): AR vs each proposer (ReDrafter, N-gram, mixed) on
the same engine, same prompts, same run, at one or more batch sizes (MT-Bench first turns by default, spread over
its categories); optionally Hugging Face `generate` (greedy, and prompt-lookup decoding) on the same weights, prompts
and threads, and llama.cpp (`--llama-cpp GGUF`, llama-cpp-python) at the weight types asked.

For each round (`--repeats`) and batch size, the prompts are decoded greedily `--batch-size` requests at a time, each
group in every mode one after the other, the mode order rotating from one group to the next and from one round to
the next (`measure.round_schedule`), so that the machine's slow phases, which last seconds, fall on every mode alike.
Reports, per batch size and mode, the median over rounds of the per-request median TPOT (ms/token); the speedup over
AR (per round, AR's mean TPOT over the mode's on the same groups: the median over rounds, and the rounds' min, max
and IQR, so a reader sees how far they agree); the mean decode-step time (`Engine.step_times`: launch to read-back),
the step cost relative to an AR step, tokens/step, acceptance, the host proposer's time per step and its share of
the step, and whether the greedy output equals AR's; then a phase breakdown of one ReDrafter request.

The baselines (baselines.py) run at batch 1 on the same token ids, each in a process of its own, so one that crashes
costs its row (with the reason), not the run; their outputs are compared with the engine's AR ones. The last stdout
line is one JSON document. Threads, compile mode and the machine's load average are recorded with the numbers. With
TP > 1 the command relaunches itself under `mpirun -n TP`; rank 0 measures and prints, the other ranks follow its
step plans as serving's do (`runtime.scheduler.follow`); the baselines then do not run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from .. import cpu
from ..checkpoint.engine_config import EngineConfig, load_engine_config
from ..config import PROPOSERS, RuntimeConfig, SamplingConfig
from ..errors import UserError
from ..model.linear import linear_paths
from ..runtime.distributed import init_dist, shutdown_dist
from ..runtime.costs import CostModel
from ..runtime.engine import Engine, frozen_heap
from ..runtime.generate import release_followers
from ..runtime.scheduler import follow
from ..runtime.step import PHASES
from . import schedule
from .baselines import LLAMA_CPP_TYPES, BaselineJob, BaselineRow, hf_baseline, llama_cpp_baseline, run_baselines
from .measure import ModeRun, RatioSummary, phase_profile, round_schedule, run_mode


@dataclass
class ModeRow:
    """One mode at one batch size, over every round."""

    batch_size: int
    mode: str  # "ar" or a proposer
    ms_per_token: float  # the median over rounds of the per-request median TPOT
    step_ms: float  # mean decode step, AR steps a speculating request took included
    propose_ms_per_step: float  # the host proposer's time per decode step
    tokens_per_step: float  # last round's mean over requests (1 for AR)
    acceptance_rate: Optional[float]  # accepted / drafted tokens, last round (None for AR)
    greedy_outputs_equal: bool  # last round's outputs == AR's
    steps_by_width: dict[int, int]  # last round's decode steps by verified tree nodes (0: AR)
    steps_by_beams: dict[int, int]  # last round's drafting tree steps by beams searched
    steps_by_depth: dict[int, int]  # ... and by the depth drafted
    round_speedups: list[float]  # per round: AR's mean TPOT over this mode's, over the same groups
    group_speedups: list[float]  # per group and round: AR's TPOT over this mode's, run back to back
    speedup: float  # the median of round_speedups: the headline
    speedup_min: float  # ... and how far the rounds disagree
    speedup_max: float
    speedup_iqr: float
    step_cost_ratio: float  # step_ms over AR's step_ms
    propose_share: float  # propose_ms_per_step over step_ms

    @property
    def ratio(self) -> RatioSummary:
        return RatioSummary.of(self.round_speedups)

    @property
    def spread(self) -> str:
        return f"{self.speedup_min:.2f}-{self.speedup_max:.2f}"


@dataclass
class _Tally:
    """One mode's runs at one batch size, accumulated over rounds."""

    seconds: float = 0.0
    steps: int = 0
    propose: float = 0.0
    tpot: list[float] = field(default_factory=list)  # per round
    round_ratios: list[float] = field(default_factory=list)
    group_ratios: list[float] = field(default_factory=list)
    last: list[ModeRun] = field(default_factory=list)  # the last round's runs, group by group

    def add(self, run: ModeRun) -> None:
        self.seconds += run.decode_s
        self.steps += run.decode_steps
        self.propose += run.propose_s

    @property
    def step_ms(self) -> float:
        return 1e3 * self.seconds / max(1, self.steps)

    @property
    def outputs(self) -> list[list[int]]:
        return [o for run in self.last for o in run.outputs]


def groups_of(prompts: list[list[int]], bs: int) -> list[list[list[int]]]:
    return [prompts[i:i + bs] for i in range(0, len(prompts), bs)]


def measure_batch(engine: Engine, prompts: list[list[int]], bs: int, modes: list[str], rounds: int,
                  params: SamplingConfig) -> tuple[list[ModeRow], list[list[int]]]:
    """Every mode on every group of `bs` prompts, `rounds` times, in `round_schedule`'s order: a row per mode, and
    AR's outputs."""
    groups = groups_of(prompts, bs)
    tally = {m: _Tally() for m in modes}
    for orders in round_schedule(modes, len(groups), rounds):
        runs: dict[str, list[ModeRun]] = {m: [] for m in modes}
        for group, order in zip(groups, orders):
            for m in order:
                run = run_mode(engine, group, params, m, last=False)
                tally[m].add(run)
                runs[m].append(run)
        for m in modes:
            t = tally[m]
            t.last = runs[m]
            t.tpot.append(statistics.median(r.ms_per_token for run in runs[m] for r in run.results))
            t.round_ratios.append(sum(r.tpot_ms for r in runs["ar"]) / sum(r.tpot_ms for r in runs[m]))
            t.group_ratios += [a.tpot_ms / r.tpot_ms for a, r in zip(runs["ar"], runs[m])]
    return [mode_row(bs, m, tally[m], tally["ar"]) for m in modes], tally["ar"].outputs


def mode_row(bs: int, mode: str, t: _Tally, ar: _Tally) -> ModeRow:
    results = [r for run in t.last for r in run.results]
    widths: dict[int, int] = {}
    beams: dict[int, int] = {}
    depths: dict[int, int] = {}
    for run in t.last:
        for w, n in run.widths.items():
            widths[w] = widths.get(w, 0) + n
        for k, n in run.beams.items():
            beams[k] = beams.get(k, 0) + n
        for d, n in run.depths.items():
            depths[d] = depths.get(d, 0) + n
    ratio = RatioSummary.of(t.round_ratios)
    speculative = mode != "ar"
    step_ms, propose_ms = t.step_ms, 1e3 * t.propose / max(1, t.steps)
    drafted = sum(r.draft_tokens for r in results)
    return ModeRow(
        batch_size=bs, mode=mode, ms_per_token=statistics.median(t.tpot), step_ms=step_ms,
        propose_ms_per_step=propose_ms,
        tokens_per_step=statistics.mean(r.tokens_per_step for r in results) if speculative else 1.0,
        acceptance_rate=sum(r.accepted_draft_tokens for r in results) / max(1, drafted) if speculative else None,
        greedy_outputs_equal=t.outputs == ar.outputs, steps_by_width=widths, steps_by_beams=beams,
        steps_by_depth=depths,
        round_speedups=t.round_ratios,
        group_speedups=t.group_ratios, speedup=ratio.median, speedup_min=ratio.min, speedup_max=ratio.max,
        speedup_iqr=ratio.iqr, step_cost_ratio=step_ms / ar.step_ms if ar.step_ms else 0.0,
        propose_share=propose_ms / step_ms if step_ms else 0.0)


def warm_up(engine: Engine, prompts: list[list[int]], batches: list[int], modes: list[str],
            params: SamplingConfig) -> None:
    """Every mode at every batch size once, not counted: the first variants compile or capture here."""
    for bs in batches:
        for m in modes:
            for group in groups_of(prompts, bs):
                run_mode(engine, group, params, m, last=False)


def resolve_modes(spec: str, ecfg: EngineConfig) -> list[str]:
    have = ("ar", *PROPOSERS) if ecfg.has_drafter else ("ar", "ngram")
    modes = [m.strip() for m in spec.split(",") if m.strip()] or list(have)
    if "ar" not in modes or any(m not in have for m in modes) or len(set(modes)) != len(modes):
        raise UserError(f"--modes must include ar and name each mode once, only modes of this engine: "
                        f"{','.join(have)}; got {spec!r}.")
    return modes


def llama_cpp_kinds(spec: str) -> list[str]:
    kinds = [k.strip() for k in spec.split(",") if k.strip()]
    if any(k not in LLAMA_CPP_TYPES for k in kinds):
        raise UserError(f"--llama-cpp-types: choose from {', '.join(LLAMA_CPP_TYPES)}; got {spec!r}.")
    return kinds


def encode_prompts(tok, args: argparse.Namespace) -> tuple[list[list[int]], str]:
    """Token ids of the prompts, as the served preprocessing model would make them, and the chat template applied
    (`--chat-template` as `bench`'s; auto: MT-Bench first turns in the tokenizer's template, else Vicuna v1.1): the
    first --num-prompts, spread over the dataset's categories or in its order (`schedule.first_prompts`)."""
    prompts = schedule.first_prompts(schedule.load_prompts(args.prompts, args.chat_template, tok), args.num_prompts,
                                     args.prompt_order)
    return [p.ids(tok) for p in prompts], schedule.applied_template(prompts)


def memory_roofline(engine: Engine, device: torch.device, buffer_mb: int = 512) -> Optional[dict]:
    """This machine's read bandwidth (a sum over a buffer much larger than the caches) and the bytes of the base's
    linear layers as the engine holds them (packed floats, or quantized bytes and scales): the floor of an AR step."""
    from ..model.linear import Linear

    if device.type != "cpu":
        return None
    weight_bytes = 0
    for m in engine.model.modules():
        if isinstance(m, Linear):
            # oneDNN's packed weight is an opaque mkldnn tensor of the weight's shape and dtype: its elements count
            held = [m.packed if m.packed is not None else m.weight] + ([m.quant[0]] if m.quant else [])
            weight_bytes += sum(t.numel() * t.element_size() for t in held if t is not None)
    gbs = read_bandwidth(buffer_mb)
    return {"read_gb_s": gbs, "buffer_mb": buffer_mb, "weight_mb": weight_bytes / 1e6,
            "floor_ms": weight_bytes / 1e6 / gbs}


def read_bandwidth(buffer_mb: int = 512) -> float:
    """This machine's read bandwidth now, GB/s: the median of 5 sums over a buffer much larger than the caches."""
    buf = torch.ones(buffer_mb * 2 ** 20 // 4)
    buf.sum()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t0)
    return buf.numel() * 4 / statistics.median(times) / 1e9


@dataclass
class Measured:
    """What rank 0 measured on the engine."""

    prompts: list[list[int]]
    max_tokens: int
    chat_template: str
    rows: list[ModeRow]
    phases: dict[str, float]
    phases_speculate: str  # the speculation the phases' steps ran under (`phase_profile`)
    ar_outputs: Optional[list[list[int]]]  # AR's at batch 1 (the baselines' reference), if measured


def measure_engine(engine: Engine, ecfg: EngineConfig, args: argparse.Namespace, modes: list[str],
                   batches: list[int]) -> Measured:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(Path(args.engine) / "tokenizer"))
    ids, chat_template = encode_prompts(tok, args)
    prompts = [p[-ecfg.build.max_input_len:] for p in ids]
    max_tokens = min(args.max_tokens, ecfg.build.max_seq_len - max(map(len, prompts)))
    params = SamplingConfig(max_tokens=max_tokens)
    warm_up(engine, prompts, batches, modes, params)
    rows, ar1 = [], None
    for bs in batches:
        batch_rows, ar_outputs = measure_batch(engine, prompts, bs, modes, args.repeats, params)
        ar1 = ar_outputs if bs == 1 else ar1  # the baselines' reference: they decode one prompt at a time
        for r in batch_rows:
            print(f"batch {bs}: {r.mode} {r.ms_per_token:.3f} ms/token; vs AR, paired per group: "
                  f"{r.ratio.describe()}", file=sys.stderr)
        rows += batch_rows
    # the phase breakdown of one ReDrafter request, each phase its own unit
    phases, speculation = phase_profile(engine, prompts[:1], params, last=False) if ecfg.has_drafter else ({}, "")
    return Measured(prompts, max_tokens, chat_template, rows, phases, speculation, ar1)


def peer_baselines(args: argparse.Namespace, kinds: list[str], m: Measured, threads: int) -> list[BaselineRow]:
    """HF generate and llama.cpp at batch 1 on the same token ids and threads, each in its own process."""
    todo = [hf_baseline(args.hf_model, args.hf_lookup_tokens)] if args.hf_model else []
    todo += [llama_cpp_baseline(args.llama_cpp, k) for k in kinds]
    if not todo:
        return []
    ar_ms = next((r.ms_per_token for r in m.rows if r.batch_size == 1 and r.mode == "ar"), None)
    rows = run_baselines(todo, BaselineJob(m.prompts, m.max_tokens, args.repeats, threads), m.ar_outputs, ar_ms)
    for r in rows:
        print(f"batch 1: {r.name} " + (f"failed: {r.error}" if r.error else f"{r.ms_per_token:.3f} ms/token"),
              file=sys.stderr)
    return rows


def summary_doc(args: argparse.Namespace, ecfg: EngineConfig, engine: Engine, runtime: RuntimeConfig, m: Measured,
                peers: list[BaselineRow], load_s: float, roofline: Optional[dict], device: str,
                costs: CostModel) -> dict:
    """The run as one JSON document: the engine and how it ran, every row, the baselines, the machine."""
    return {
        "engine": str(args.engine), "tp": ecfg.tp_size, "dtype": str(engine.dtype).removeprefix("torch."),
        "num_beams": ecfg.tree.num_beams, "draft_len_per_beam": ecfg.tree.draft_len_per_beam,
        "proposer": ecfg.proposer.to_dict(), "prompts": len(m.prompts), "prompt_order": args.prompt_order,
        "max_tokens": m.max_tokens, "chat_template": m.chat_template, "repeats": args.repeats,
        "rows": [dataclasses.asdict(r) for r in m.rows], "hf": {r.name: r.to_dict() for r in peers},
        "phases_ms": m.phases, "phases_speculate": m.phases_speculate, "runtime": runtime.to_dict(),
        "compile": engine.compiler.mode,
        "cpp_wrapper": engine.compiler.cpp_wrapper,
        "kernels": engine.kernels, "linear_paths": linear_paths(engine.model, engine.drafter),
        "drafting": engine.device_drafter.path if engine.device_drafter is not None else None,
        "engine_load_s": load_s, "speculate": str(engine.policy.speculation),
        "cost_model": costs.to_dict(), "speculation_overheads": costs.overheads(),
        "step_scale": dict(zip(("ar", "tree"), engine.policy.step_scale)),
        "between_steps_ms": dict(zip(("ar", "tree"), engine.policy.between)),
        "switch_ms": dict(zip(("ar", "tree"), engine.policy.switch)), "roofline": roofline,
        "machine": {"cpu": cpu.model_name(), "family": cpu.cpuinfo("cpu family"), "features": cpu.features(),
                    "cores": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(), "loadavg": os.getloadavg(), "device": device},
    }


def _probe_rest(engine: Engine) -> int:
    """The fewest AR steps the policy rests before a probe at batch 1 and the shorter context, on its costs now."""
    return engine.policy.step_costs().probe_rest(1, engine.policy.costs.contexts[0])


def print_header(doc: dict, engine: Engine) -> None:
    print(f"{doc['tp']} rank(s), {doc['dtype']}, nb={doc['num_beams']} dl={doc['draft_len_per_beam']}, "
          f"compile {doc['compile']}, kernels {doc['kernels']}, {torch.get_num_threads()} torch thread(s), "
          f"load average {os.getloadavg()[0]:.2f}; {doc['prompts']} prompts ({doc['prompt_order']} order) x "
          f"{doc['max_tokens']} tokens, greedy; medians of {doc['repeats']} rounds, the modes alternating per "
          f"prompt group")
    m = doc["machine"]
    if m["device"] == "cpu":
        family = f" (family {m['family']})" if m.get("family") else ""
        print(f"CPU: {m['cpu']}{family}, {m['cores']} cores, {' '.join(m['features']) or 'no AVX2'}")
    print("linear layers (base and drafter) by kernel: " +
          ", ".join(f"{n} {path}" for path, n in doc["linear_paths"].items()))
    if doc.get("drafting"):
        print(f"the drafter's beam search: {doc['drafting']}")
    costs = CostModel.from_dict(doc["cost_model"])
    if engine.policy.speculation.auto:
        print(f"speculation policy: auto; the step cost model (ms) it decides with, measured at load or cached beside "
              f"the engine:\n{costs.table()}")
        ar_scale, tree_scale = engine.policy.step_scale
        print(f"the steps as they ran against that model (the policy's running ratio of measured to modelled time, "
              f"at the end of the run): AR steps {ar_scale:.2f}x, tree steps {tree_scale:.2f}x; the host's time "
              f"between steps, which it adds: {engine.policy.between[0]:.3f} ms after AR steps, "
              f"{engine.policy.between[1]:.3f} ms after tree steps; what the first step of a kind costs more after the "
              f"other kind: {engine.policy.switch[0]:.3f} ms (AR after trees), {engine.policy.switch[1]:.3f} ms (a tree "
              f"step after AR steps), so that a probe comes after at least "
              f"{_probe_rest(engine)} AR steps at batch 1")
    else:
        print(f"speculation policy: {doc['speculate']} (fixed tree width); the step cost model (ms) of this engine "
              f"here:\n{costs.table()}")
    print(f"what speculating costs (from that model): the fixed cost of a tree step before any node is verified, and "
          f"each verified node's\n{costs.overhead_table()}")


def print_table(rows: list[ModeRow], peers: list[BaselineRow]) -> None:
    print("| batch | mode | ms/token | speedup vs AR (rounds min-max) | step ms | step cost vs AR | tokens/step | "
          "acceptance | proposer ms/step (share) | steps by verified nodes (0: AR) | greedy == AR |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        acc = "-" if r.acceptance_rate is None else f"{r.acceptance_rate:.2f}"
        by_width = " ".join(f"{w}:{n}" for w, n in sorted(r.steps_by_width.items()))
        print(f"| {r.batch_size} | {r.mode} | {r.ms_per_token:.3f} | {r.speedup:.2f}x ({r.spread}) | "
              f"{r.step_ms:.3f} | {r.step_cost_ratio:.2f} | {r.tokens_per_step:.2f} | {acc} | "
              f"{r.propose_ms_per_step:.3f} ({100 * r.propose_share:.1f}%) | {by_width} | {r.greedy_outputs_equal} |")
    for p in peers:
        if p.error:
            print(f"| 1 | {p.name} | failed: {p.error} | - | - | - | - | - | - | - | - |")
            continue
        speedup = "-" if p.speedup is None else f"{p.speedup:.2f}x"
        print(f"| 1 | {p.name} | {p.ms_per_token:.3f} | {speedup} | - | - | - | - | - | - | "
              f"{p.outputs_equal_to_ar or p.greedy_outputs_equal} |")
    for r in rows:
        if r.steps_by_beams:
            print(f"batch {r.batch_size} {r.mode}: tree steps that drafted, by beams searched: "
                  + " ".join(f"{k}:{n}" for k, n in sorted(r.steps_by_beams.items())))
        if r.steps_by_depth:
            print(f"batch {r.batch_size} {r.mode}: tree steps that drafted, by depth drafted: "
                  + " ".join(f"{d}:{n}" for d, n in sorted(r.steps_by_depth.items())))
    for r in rows:
        if r.ratio.straddles_one:
            print(f"batch {r.batch_size} {r.mode}: the rounds disagree on whether it is faster than AR "
                  f"({r.spread}x); the median alone is no verdict")


def print_footer(doc: dict) -> None:
    roofline, phases = doc["roofline"], doc["phases_ms"]
    ar1 = next((r["ms_per_token"] for r in doc["rows"] if r["batch_size"] == 1 and r["mode"] == "ar"), None)
    if roofline and ar1:
        print(f"memory roofline: this machine reads {roofline['read_gb_s']:.1f} GB/s (one thread per core, a "
              f"{roofline['buffer_mb']} MB sum, median of 5); the base's linear layers hold "
              f"{roofline['weight_mb']:.1f} MB, read once per AR step: {roofline['floor_ms']:.2f} ms/token at best; "
              f"AR at batch 1 is at {100 * roofline['floor_ms'] / ar1:.0f}% of that bound")
    if phases:
        total = sum(phases.values()) or 1.0
        shares = ", ".join(f"{k} {phases.get(k, 0.0):.3f} ms ({100 * phases.get(k, 0.0) / total:.0f}%)" for k in PHASES)
        print(f"ReDrafter step phases (batch 1, --speculate {doc['phases_speculate']}, each phase timed alone): "
              f"{shares}")


def run(args: argparse.Namespace) -> int:
    """The benchmark on this rank (the command relaunched it under mpirun for TP > 1): rank 0 measures and prints,
    the others follow its step plans."""
    runtime = RuntimeConfig.from_sources(None, args)
    split = runtime.profile_phases  # the timed runs take whole steps; `phase_profile` splits its own run's phases
    runtime = runtime.replace(profile_phases=False)
    ecfg = load_engine_config(args.engine)
    modes, batches = resolve_modes(args.modes, ecfg), [int(b) for b in args.batch_size.split(",")]
    kinds = llama_cpp_kinds(args.llama_cpp_types) if args.llama_cpp else []
    dist = init_dist(ecfg.tp_size, runtime.device)
    if split and dist.is_driver:
        print("--profile-phases: bench-engine prints the phase breakdown anyway, from a run of its own; its timed runs "
              "and the cost model take whole steps", file=sys.stderr)
    try:
        t0 = time.perf_counter()
        engine = Engine.load(args.engine, dist, runtime)
        load_s = time.perf_counter() - t0
        with frozen_heap():
            # what speculating costs (cost model), measured even where the policy does not decide by it; every rank
            # takes part, as the measurement's steps are collective
            costs = engine.policy.costs or engine.cost_model()
            if not dist.is_driver:
                follow(engine)  # rank 0's step plans, as a TP server's followers take them, until it releases us
                return 0
            try:
                measured = measure_engine(engine, ecfg, args, modes, batches)
            finally:
                release_followers(engine)
    finally:
        shutdown_dist()
    peers = peer_baselines(args, kinds, measured, torch.get_num_threads()) if ecfg.tp_size == 1 else []
    doc = summary_doc(args, ecfg, engine, runtime, measured, peers, load_s, memory_roofline(engine, dist.device),
                      str(dist.device), costs)
    print_header(doc, engine)
    print_table(measured.rows, peers)
    print_footer(doc)
    print(json.dumps(doc))
    return 0
