"""The built wheel, installed as users install it, makes and serves a model repository.

The wheel is built from a copy of the sources (pyproject.toml, README.md, trt_redrafter/) without the checkout's
build/ and *.egg-info/: setuptools reuses a stale build/lib and an egg-info's SOURCES.txt, either of which can put
files in a wheel that its package-data declaration no longer names. It goes into a fresh virtualenv with
--system-site-packages (torch, transformers, tritonclient and nvidia-pytriton come from the system, which also has
the editable install of this checkout), and every stage runs through that venv's `trt-redrafter` from a directory
outside the checkout: make-tiny -> convert -> build-engine -> make-repo -> serve, one request through the ensemble,
whose greedy output must equal `run --mode ar`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_serving import _require_server

from trt_redrafter.runtime.distributed import free_port

ROOT = Path(__file__).resolve().parents[1]
WHEEL_SOURCES = ("pyproject.toml", "README.md", "trt_redrafter")
PROMPT = "The quick brown fox"
MAX_TOKENS = 24
SERVE_READY_S = 300.0  # the torch engine model imports torch and loads the engine; the 2 cores are shared
SERVE_STOP_S = 60.0


def _clean_env() -> dict[str, str]:
    """The environment without anything that would put the checkout on the venv's sys.path."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}


def _check(cmd: list, cwd: Path, env: dict[str, str]) -> str:
    res = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=600,
                         check=False)
    assert res.returncode == 0, (f"{' '.join(map(str, cmd))} exited {res.returncode}\n"
                                 f"stdout:\n{res.stdout[-3000:]}\nstderr:\n{res.stderr[-3000:]}")
    return res.stdout


def _last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def build_wheel(dst: Path, env: dict[str, str]) -> Path:
    src = dst / "src"
    src.mkdir(parents=True)
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for name in WHEEL_SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=skip)
        else:
            shutil.copy2(ROOT / name, src / name)
    _check([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", dst / "dist", src],
           dst, env)
    wheels = sorted((dst / "dist").glob("trt_redrafter-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def make_venv(venv: Path, wheel: Path, env: dict[str, str]) -> Path:
    """A venv whose trt_redrafter is the wheel's; returns its python. pip comes from the system site-packages, and
    --ignore-installed never uninstalls the system's editable trt-redrafter."""
    _check([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv], venv.parent, env)
    python = venv / "bin" / "python"
    _check([python, "-m", "pip", "install", "--no-deps", "--ignore-installed", "--no-compile", wheel],
           venv.parent, env)
    return python


@pytest.mark.slow
@pytest.mark.server
def test_installed_wheel_makes_and_serves_a_repository(tmp_path):
    _require_server()
    env = _clean_env()
    work = tmp_path / "work"  # the cwd of every command: outside the checkout, so '' on sys.path is not it
    work.mkdir()
    wheel = build_wheel(tmp_path / "wheel", env)
    python = make_venv(tmp_path / "venv", wheel, env)
    probe = ("import json, trt_redrafter, trt_redrafter.serving.repo as r, trt_redrafter.cpu as c; "
             "print(json.dumps([trt_redrafter.__file__, str(r.TEMPLATES), c._SOURCES]))")
    where = _last_json(_check([python, "-c", probe], work, env))
    site = (tmp_path / "venv").resolve()
    assert Path(where[0]).resolve().is_relative_to(site), f"the venv imports trt_redrafter from {where[0]}"
    assert Path(where[1]).resolve().is_relative_to(site), where[1]
    # the CPU kernels' sources and their header ship in the wheel (built at first use; without them auto falls back)
    assert [Path(p).name for p in where[2] if Path(p).is_file() and Path(p).resolve().is_relative_to(site)] == \
        ["linear.cpp", "attention.cpp", "topk.cpp", "draft.cpp"], where[2]
    for header in ("simd.h", "kernels.h"):
        assert (Path(where[2][0]).parent / header).is_file(), f"{header} is not in the wheel"

    cli = tmp_path / "venv" / "bin" / "trt-redrafter"
    tiny, ckpt, engine, repo = work / "tiny", work / "ckpt", work / "engine", work / "repo"
    _check([cli, "make-tiny", "--output", tiny, "--seed", 3], work, env)
    _check([cli, "convert", "--base-model", tiny / "base", "--drafter", tiny / "drafter", "--output", ckpt,
            "--tp", 1, "--dtype", "float32", "--num-beams", 2, "--draft-len-per-beam", 2], work, env)
    _check([cli, "build-engine", "--checkpoint", ckpt, "--output", engine, "--tp", 1, "--backend", "torch",
            "--max-batch-size", 2, "--max-input-len", 64, "--max-seq-len", 160, "--tokenizer", tiny / "base"],
           work, env)
    # the templates come from the wheel: without them make-repo stops here with "the Triton templates are missing"
    _check([cli, "make-repo", "--engine", engine, "--output", repo, "--compile", "off"], work, env)
    want = _last_json(_check([cli, "run", "--engine", engine, "--prompt", PROMPT, "--max-tokens", MAX_TOKENS,
                              "--mode", "ar", "--compile", "off", "--json"], work, env))["output_ids"]
    assert want

    ports = {"--grpc-port": free_port(), "--http-port": free_port(), "--metrics-port": free_port()}
    log = tmp_path / "serve.log"
    with open(log, "w") as err, open(tmp_path / "serve.out", "w") as out:
        serve = subprocess.Popen([str(cli), "serve", "--repo", str(repo), "--ready-timeout", str(SERVE_READY_S),
                                  *[str(x) for kv in ports.items() for x in kv]],
                                 cwd=work, env=env, stdout=out, stderr=err, start_new_session=True)
    try:
        deadline = time.monotonic() + SERVE_READY_S + 30
        while "serving " not in (tmp_path / "serve.out").read_text():
            assert serve.poll() is None, f"serve exited {serve.returncode}:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"serve not ready:\n{log.read_text()[-3000:]}"
            time.sleep(0.5)
        got = _last_json(_check([cli, "generate", "--url", f"127.0.0.1:{ports['--grpc-port']}", "--prompt", PROMPT,
                                 "--max-tokens", MAX_TOKENS, "--json"], work, env))
        assert got["error"] is None and got["output_ids"] == want
    finally:
        if serve.poll() is None:
            serve.send_signal(signal.SIGTERM)  # serve's own clean shutdown: drain, stop tritonserver, remove shm
            try:
                serve.wait(SERVE_STOP_S)
            except subprocess.TimeoutExpired:
                os.killpg(serve.pid, signal.SIGKILL)
                serve.wait()
    assert serve.returncode == 0, f"serve exited {serve.returncode}:\n{log.read_text()[-3000:]}"
    assert (tmp_path / "serve.out").read_text().rstrip().endswith("stopped")
