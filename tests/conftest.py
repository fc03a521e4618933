"""The test tiers, and shared fixtures: tiny random Llama + drafter pairs written by `make-tiny`'s library function.

Tiers: `python3 -m pytest` runs the fast tier, every module's core behaviour in a few minutes; `--tier integration`
runs the rest of what starts real servers, mpirun ranks, inductor compilations or training (tests marked slow, server
or mpi, except those also marked core: the fast tier's one real tritonserver, OpenAI frontend and mpirun run each);
`--tier all` both. CI runs the two tiers one after the other (.ci/run). Every test has a timeout (pyproject.toml;
`@pytest.mark.timeout(S)` where one needs longer).

`tiny_pair` is the default-size pair (DIR with base/ and drafter/); `make_tiny_pair(**sizes)` makes (and caches
for the session) a pair with other `TinyConfig` sizes, e.g. `make_tiny_pair(num_kv_heads=1, exit_dim=96)`.
Treat both as read-only: copy a directory before editing it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import pytest

# One inductor cache for every engine the tests compile, in this process and in those it starts (run, serve, mpirun
# ranks, pytest-xdist workers), kept between sessions: a step graph that two tests compile at the same shapes compiles
# once (test_policy.py's compiled widths find test_compiled.py's graphs: 30 s instead of 171 on a 2-core CPU without
# AVX-512), and CI's integration tier finds the fast tier's. Set before the runtime is imported, which reads it
# (runtime/loading.py); a TORCHINDUCTOR_CACHE_DIR the user set wins. Delete out/test-inductor for a cold run.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(__file__).resolve().parents[1] / "out" / "test-inductor"))

import torch  # noqa: E402

from trt_redrafter.checkpoint.tiny import TinyConfig, make_tiny  # noqa: E402

INTEGRATION_MARKERS = ("slow", "server", "mpi")
TIERS = ("fast", "integration", "all")


def pytest_addoption(parser):
    parser.addoption("--tier", choices=TIERS, default="fast",
                     help="fast (default): every module's core behaviour; integration: tests marked "
                          f"{' / '.join(INTEGRATION_MARKERS)} (real tritonserver, mpirun ranks, inductor, training); "
                          "all: both")


def _integration(item) -> bool:
    return item.get_closest_marker("core") is None and \
        any(item.get_closest_marker(m) is not None for m in INTEGRATION_MARKERS)


def pytest_collection_modifyitems(config, items):
    tier = config.getoption("--tier")
    if tier == "all":
        return
    keep = [i for i in items if _integration(i) == (tier == "integration")]
    if len(keep) < len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep


def pytest_report_header(config):
    tier = config.getoption("--tier")
    other = {"fast": "--tier integration or --tier all", "integration": "--tier fast or --tier all"}.get(tier)
    return f"test tier: {tier}" + (f" (the rest: {other})" if other else "")


@pytest.fixture(scope="session")
def make_tiny_pair(tmp_path_factory) -> Callable[..., Path]:
    cache: dict[tuple, Path] = {}

    def make(**sizes) -> Path:
        key = tuple(sorted(sizes.items()))
        if key not in cache:
            out = tmp_path_factory.mktemp("tiny") / "pair"
            make_tiny(out, TinyConfig(**sizes))
            cache[key] = out
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_pair(make_tiny_pair) -> Path:
    return make_tiny_pair()


_INDUCTOR_CACHE_AT_START = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
_THREADS_AT_START = torch.get_num_threads()


@pytest.fixture(autouse=True)
def _own_torch_threads():
    """Put back torch's thread count after each test: an engine loaded with `threads` sets it for the process
    (runtime/engine.py), and inductor compiles a CPU graph for the count at hand (its kernels' OpenMP teams, part of
    its cache key), so a later test in the same process (a pytest-xdist worker's next module) compiled again the
    graphs that the shared cache above already held, and ran at another count than it was written for."""
    yield
    if torch.get_num_threads() != _THREADS_AT_START:
        torch.set_num_threads(_THREADS_AT_START)


@pytest.fixture(autouse=True)
def _own_inductor_cache_dir():
    """An engine compiled in this process points TORCHINDUCTOR_CACHE_DIR at its own directory (Engine.
    _keep_inductor_cache); put back the value the session started with after each test (not the one before it: a
    module-scoped engine sets it before the first test's function fixtures run), so that a later test's child
    processes (run, serve, mpirun ranks) use their own engine's cache, as a user's would, not an in-process engine's."""
    yield
    if _INDUCTOR_CACHE_AT_START is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = _INDUCTOR_CACHE_AT_START
