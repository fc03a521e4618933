"""The results document (one JSON per run), its markdown table, and the facts that make a number reproducible."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from ..errors import UserError
from ..fsutil import read_json, write_json

SCHEMA = "trt-redrafter-bench/1"


def git_revision(root: Optional[Path] = None) -> dict:
    root = root or Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {"sha": None, "dirty": None}
    return {"sha": sha or None, "dirty": bool(dirty) if sha else None}


def machine_info() -> dict:
    from .. import cpu

    info = {"hostname": platform.node(), "platform": platform.platform(), "python": sys.version.split()[0],
            "cpu": cpu.model_name(), "cpu_count": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None, "gpus": []}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        pass
    return info


def make_document(config: dict, sweep: dict, engines: dict, command: Optional[list[str]] = None) -> dict:
    return {"schema": SCHEMA, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": command,
            "git": git_revision(), "machine": machine_info(), "config": config, "engines": engines, **sweep}


def load_document(path: str | Path, what: str) -> dict:
    doc = read_json(path, what)
    if doc.get("schema") != SCHEMA:
        raise UserError(f"{what}: {path} is not a `trt-redrafter bench` results document (schema "
                        f"{doc.get('schema')!r}, expected {SCHEMA!r}).")
    for key in ("points", "speedups", "config"):
        if key not in doc:
            raise UserError(f"{what}: {path} has no '{key}'; re-run `trt-redrafter bench`.")
    return doc


def baseline_of(doc: dict) -> dict:
    """The document without per-request records (a baseline keeps per-point metrics only: small, diffable)."""
    out = dict(doc)
    out["runs"] = [{k: v for k, v in run.items() if k != "requests"} for run in doc.get("runs", [])]
    return out


def _f(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def markdown(doc: dict) -> str:
    """One row per (TP, QPS, mode) with medians over repeats, then the speedups over AR."""
    cfg = doc["config"]
    speed = doc["speedups"]
    lines = [f"Medians over {cfg.get('repeats', 1)} repeat(s); {cfg.get('num_requests')} requests per point "
             f"(+{cfg.get('warmup')} warm-up), max_tokens {cfg.get('max_tokens')}, "
             f"{'greedy' if not cfg.get('temperature') else 'T=' + str(cfg.get('temperature'))}, "
             f"dataset `{Path(str(cfg.get('dataset'))).name}`.",
             "",
             "| TP | QPS | mode | TPOT ms/token p50 | p90 | p99 | TTFT ms p50 | p99 | ITL ms p50 | E2E ms p50 | p99 "
             "| req/s | out tok/s | tokens/step | accept | errors |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in doc["points"]:
        m = p["metrics"]
        lines.append(
            f"| {p['tp']} | {p['qps']:g} | {p['mode']} | {_f(m['tpot_ms']['median'])} | {_f(m['tpot_ms']['p90'])} "
            f"| {_f(m['tpot_ms']['p99'])} | {_f(m['ttft_ms']['median'])} | {_f(m['ttft_ms']['p99'])} "
            f"| {_f(m['itl_ms']['median'])} | {_f(m['e2e_ms']['median'], 1)} | {_f(m['e2e_ms']['p99'], 1)} "
            f"| {_f(m['request_throughput'], 3)} | {_f(m['output_throughput'], 1)} | {_f(m['tokens_per_step'])} "
            f"| {_f(m['acceptance_rate'])} | {m['errors']} |")
    if speed:
        lines += ["", "| TP | QPS | mode | speedup over AR (TPOT p50 ratio) | min over repeats | max over repeats |",
                  "|---|---|---|---|---|---|"]
        for s in speed:
            lines.append(f"| {s['tp']} | {s['qps']:g} | {s.get('mode', 'redrafter')} | {_f(s['speedup'], 3)} "
                         f"| {_f(s['min'], 3)} | {_f(s['max'], 3)} |")
    return "\n".join(lines) + "\n"


def write_outputs(doc: dict, out_dir: str | Path, plots: bool = True) -> dict[str, Path]:
    """results.json, results.md and (with matplotlib) the PNG plots, in out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {"json": out / "results.json", "markdown": out / "results.md"}
    write_json(files["json"], doc, indent=1)
    files["markdown"].write_text(markdown(doc))
    if plots:
        from .plots import plot_all

        files.update(plot_all(doc, out))
    return files
