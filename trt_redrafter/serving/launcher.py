"""Start a real `tritonserver` on a model repository, wait until it is ready, and shut it down cleanly.

Which server: a system `tritonserver` on PATH (or /opt/tritonserver, as in NGC containers), else the one bundled
in the `nvidia-pytriton` wheel. The bundled one needs what PyTriton sets up internally (found on this project's
CPU machines, docs/serving.md): a backend directory holding the Python backend next to the stub built for this
interpreter's X.Y, `LD_LIBRARY_PATH` starting with this interpreter's libpython (else the stub may load another
3.X.Y build's and crash) and the wheel's vendored libraries, and this interpreter's bin directory first on PATH
(the stub finds its prefix, and so NumPy < 2, through `python3` on PATH; NumPy 2 silently corrupts tensors).

A `tensorrtllm` repository (make-repo --backend tensorrtllm: TensorRT-LLM's C++ backend) runs the way
TensorRT-LLM's `scripts/launch_triton_server.py` starts it (tensorrtllm_backend @ c2e65b8, `get_cmd`): one
tritonserver per TP rank under one mpirun, `mpirun --allow-run-as-root -n 1 tritonserver ARGS0 : -n 1 tritonserver
ARGS1 : ...`, every rank with the same ports and `--disable-auto-complete-config
--backend-config=python,shm-region-prefix-name=<prefix><rank>_`, ranks > 0 with `--model-control-mode=explicit
--load-model=tensorrt_llm`. The backend's leader (rank 0) serves; the others stay inside the engine's model load,
so they never bind the ports. mpirun forwards the SIGINT below to every rank.

Shutdown order (SIGINT alone breaks ensemble streams that are still open, and can leave the stub and a
/dev/shm region behind):
    1. drain   a `stop=true` request with id DRAIN_REQUEST_ID ends every open stream with a final response
    2. SIGINT  tritonserver unloads the models (the engine model stops its follower ranks) and exits
    3. kill    anything left in the server's process group (stubs, mpirun followers) after the timeout
    4. clean   remove /dev/shm/<this launch's unique prefix>* and the temporary backend directory
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Optional, TextIO

import numpy as np

from ..errors import UserError
from ..log import get_logger
from . import DRAIN_REQUEST_ID, ENGINE_MODEL

logger = get_logger(__name__)

SYSTEM_TRITON = ("/opt/tritonserver/bin/tritonserver",)
SHM_PREFIX_STEM = "trtrd"
LOG_TAIL_LINES = 40


def _pytriton_home() -> Optional[Path]:
    try:
        import pytriton
    except ImportError:
        return None
    home = Path(pytriton.__file__).parent / "tritonserver"
    return home if (home / "bin" / "tritonserver").is_file() else None


def find_tritonserver() -> tuple[Path, bool]:
    """(binary, bundled): the system server where installed, else nvidia-pytriton's."""
    found = shutil.which("tritonserver") or next((p for p in SYSTEM_TRITON if os.path.isfile(p)), None)
    if found:
        return Path(found), False
    home = _pytriton_home()
    if home is None:
        raise UserError("no tritonserver found: install the serving extra (pip install 'trt-redrafter[serving]', "
                        "which bundles one) or run inside NVIDIA's Triton container.")
    return home / "bin" / "tritonserver", True


def _bundled_backends(home: Path, dst: Path) -> Path:
    """dst/python = the bundle's Python backend + the stub matching this interpreter (as PyTriton does)."""
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = home / "python_backend_stubs" / ver / "triton_python_backend_stub"
    if not stub.is_file():
        raise UserError(f"nvidia-pytriton has no Python-backend stub for Python {ver}; use Python 3.8-3.13.")
    py = dst / "python"
    py.mkdir(parents=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        os.symlink(home / "backends" / "python" / name, py / name)
    shutil.copy2(stub, py / "triton_python_backend_stub")
    return dst


def package_env() -> dict[str, str]:
    """This environment with this checkout's trt_redrafter first on PYTHONPATH (for the processes serve starts)."""
    env = dict(os.environ)
    pkg_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([pkg_root, env.get("PYTHONPATH", "")]).rstrip(":")
    return env


def server_env(bundled: bool) -> dict[str, str]:
    env = package_env()  # model.py files import trt_redrafter from here too
    libdirs = [sysconfig.get_config_var("LIBDIR") or ""]
    if bundled:
        home = _pytriton_home()
        libdirs.append(str(home.parents[1] / "nvidia_pytriton.libs"))
    env["LD_LIBRARY_PATH"] = os.pathsep.join([d for d in libdirs if d] + [env.get("LD_LIBRARY_PATH", "")]).rstrip(":")
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    return env


CONTAINER_MARKERS = (".dockerenv", "run/.containerenv")  # Docker; Podman and other OCI runtimes


def in_container(root: str | Path = "/") -> bool:
    """Whether this process runs in a container (Docker, Podman, Kubernetes), where 127.0.0.1 is the container's
    own loopback: nothing outside it, not even `docker run -p 8000:8000`, can reach a server bound there."""
    return any((Path(root) / m).exists() for m in CONTAINER_MARKERS) or "KUBERNETES_SERVICE_HOST" in os.environ


def default_host(root: str | Path = "/") -> str:
    """Where `serve` binds when --host is not given: every interface inside a container (reachable only through
    the ports it publishes, as tritonserver and vLLM's server bind by default), else loopback only."""
    return "0.0.0.0" if in_container(root) else "127.0.0.1"


def connect_host(host: str) -> str:
    """The address a client on this machine dials for a server bound to `host` (a wildcard is not a peer)."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def port_in_use(host: str, port: int) -> bool:
    """Whether binding host:port fails the way a server's listen would (SO_REUSEADDR, as servers set it)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def require_free_ports(host: str, ports: dict[str, int]) -> None:
    """One UserError for the first flag whose port is taken (or given twice), before any server starts."""
    seen: dict[int, str] = {}
    for flag, port in ports.items():
        if port in seen:
            raise UserError(f"{seen[port]} and {flag} are both {port}; give each endpoint a port of its own.")
        seen[port] = flag
        if port_in_use(host, port):
            raise UserError(f"port {port} on {host} ({flag}) is in use by another program; stop it or pass another "
                            f"{flag}.")


def pump_output(stream, log, echo: Optional[TextIO]) -> None:
    """Copy a child's output, line by line, to its log file (and to `echo`) until the child closes it."""
    with log:
        for line in iter(stream.readline, b""):
            log.write(line)
            log.flush()
            if echo is not None:
                echo.write(line.decode(errors="replace"))
                echo.flush()


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


class ChildProcess:
    """A child process of serve's in its own process group (so that whatever it starts can be found and killed), its
    output pumped to `log_path` (a temporary file by default) and, with `echo`, to `echo` too. The one launcher:
    `TritonServer` and the OpenAI frontend (openai_api/process.py) are its two kinds. `NAME` names it in errors."""

    NAME = "the child process"

    def __init__(self, tmp_prefix: str, log_name: str, log_path: str | Path | None, echo: Optional[TextIO],
                 ready_timeout: float):
        self._tmp = Path(tempfile.mkdtemp(prefix=tmp_prefix))
        self.log_path = Path(log_path) if log_path else self._tmp / log_name
        self._echo, self.ready_timeout = echo, ready_timeout
        self.proc: Optional[subprocess.Popen] = None
        self._pump: Optional[threading.Thread] = None
        self.starts = 0

    def _spawn(self, cmd: list[str], env: dict[str, str]) -> None:
        log = open(self.log_path, "ab" if self.starts else "wb")  # a restart's log follows the first's
        self.starts += 1
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self._pump = threading.Thread(target=pump_output, args=(self.proc.stdout, log, self._echo),
                                      name=f"{Path(cmd[0]).name}-log", daemon=True)
        self._pump.start()

    def _wait_ready(self, ready: Callable[[], bool]) -> float:
        """Poll `ready` until it holds -> seconds waited; one sentence with the log's tail if the process exits or
        `ready_timeout` passes first."""
        t0 = time.monotonic()
        while not ready():
            if self.proc.poll() is not None:
                raise UserError(f"{self.NAME} exited with status {self.proc.returncode} before it was ready; "
                                f"its log ({self.log_path}) ends with:\n{self.log_tail()}")
            if time.monotonic() - t0 > self.ready_timeout:
                raise UserError(f"{self.NAME} was not ready after {self.ready_timeout:.0f} s; its log "
                                f"({self.log_path}) ends with:\n{self.log_tail()}")
            time.sleep(0.1)
        return time.monotonic() - t0

    def log_tail(self, n: int = LOG_TAIL_LINES) -> str:
        time.sleep(0.2)  # let the log pump catch up
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def poll(self) -> Optional[int]:
        return None if self.proc is None else self.proc.poll()

    def _interrupt(self, timeout: float) -> None:
        """SIGINT and wait up to `timeout` s for the process (not its group) to exit; SIGKILL it past that."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                logger.warning("%s did not exit within %.0f s; killing it", self.NAME, timeout)
                self.proc.kill()
                self.proc.wait()

    def _reap(self) -> int:
        """After the process exited: wait for the log pump, close its pipe -> the exit status."""
        rc = self.proc.returncode
        if self._pump is not None:
            self._pump.join(timeout=5)
        self.proc.stdout.close()
        self.proc = None
        return rc

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class TritonServer(ChildProcess):
    """`with TritonServer(repo, grpc_port=..., ...) as srv:` a ready server; leaving the block shuts it down.

    Logs go to `log_path` (a temporary file by default) and, with `echo`, to `echo` too. `exit_timeout`: how long
    tritonserver waits for its models to unload (its own default, 30 s): the engine model's close drains its requests
    for up to 5 s and joins its scheduler for up to 10, which a machine busy with other work can need whole.
    """

    NAME = "tritonserver"

    def __init__(self, repo: str | Path, grpc_port: int = 8001, http_port: int = 8000, metrics_port: int = 8002,
                 host: str = "127.0.0.1", ready_timeout: float = 180.0, exit_timeout: int = 30,
                 log_path: str | Path | None = None, echo: Optional[TextIO] = None, verbose: bool = False):
        self.repo = Path(repo).absolute()
        if not (self.repo / "ensemble" / "config.pbtxt").is_file() and not any(self.repo.glob("*/config.pbtxt")):
            raise UserError(f"{self.repo} is not a Triton model repository; make one with `trt-redrafter make-repo`.")
        self.engine_backend, self.world_size = repo_engine(self.repo)
        self.host, self.grpc_port, self.http_port, self.metrics_port = host, grpc_port, http_port, metrics_port
        self.exit_timeout, self.verbose = exit_timeout, verbose
        self.shm_prefix = f"{SHM_PREFIX_STEM}{os.getpid()}x{int(time.time() * 1e3) % 100000}_"
        super().__init__("trt-redrafter-triton-", "tritonserver.log", log_path, echo, ready_timeout)
        self._expected: dict[int, str] = {}

    # ---- addresses (what a client on this machine connects to) -------------------------------------------------
    @property
    def client_host(self) -> str:
        return connect_host(self.host)

    @property
    def grpc_url(self) -> str:
        return f"{self.client_host}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.client_host}:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.client_host}:{self.metrics_port}/metrics"

    # ---- start -----------------------------------------------------------------------------------------------
    def command(self, binary: Path, backends: Optional[Path]) -> list[str]:
        if self.engine_backend != "tensorrtllm":
            return self._server_args(binary, backends, self.shm_prefix)
        from ..runtime.distributed import mpirun_options

        cmd = mpirun_options(self.world_size, "a tensorrtllm repository")
        for rank in range(self.world_size):
            cmd += ["-n", "1", *self._server_args(binary, backends, f"{self.shm_prefix}{rank}_")]
            if rank:
                cmd += ["--model-control-mode=explicit", f"--load-model={ENGINE_MODEL}"]
            cmd.append(":")
        return cmd[:-1]

    def _server_args(self, binary: Path, backends: Optional[Path], shm_prefix: str) -> list[str]:
        cmd = [str(binary), f"--model-repository={self.repo}", "--disable-auto-complete-config",
               f"--http-address={self.host}", f"--http-port={self.http_port}",
               f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
               f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}",
               f"--backend-config=python,shm-region-prefix-name={shm_prefix}",
               f"--exit-timeout-secs={self.exit_timeout}"]
        if self.engine_backend != "tensorrtllm":
            cmd.append("--allow-gpu-metrics=false")
        if backends is not None:
            cmd.append(f"--backend-directory={backends}")
        if self.verbose:
            cmd.append("--log-verbose=1")
        return cmd

    def start(self) -> "TritonServer":
        binary, bundled = find_tritonserver()
        if self.engine_backend == "tensorrtllm":
            try:
                require_tensorrtllm_backend(binary, bundled)
            except UserError:
                shutil.rmtree(self._tmp, ignore_errors=True)
                raise
        backends = None
        if bundled:  # a restart reuses the directory its first start made
            backends = self._tmp / "backends"
            if not backends.is_dir():
                _bundled_backends(binary.parents[1], backends)
        cmd = self.command(binary, backends)
        logger.debug("starting %s", " ".join(cmd))
        self._spawn(cmd, server_env(bundled))
        try:
            waited = self._wait_ready(lambda: _ready(f"{self.http_url}/v2/health/ready"))
        except BaseException:
            self.stop()
            raise
        logger.info("tritonserver ready in %.1f s (gRPC %s, HTTP %s, metrics %s)", waited, self.grpc_url,
                    self.http_url, self.metrics_url)
        self._expected = self.model_processes()  # what fault() checks
        return self

    # ---- faults (serve's supervision) --------------------------------------------------------------------------
    def model_processes(self) -> dict[int, str]:
        """{pid: model instance} of the server's Python-backend stubs (one process per model instance, e.g.
        `tensorrt_llm_0_0`: the stub's 9th argument, the name Triton's "Stub process ... is not healthy" uses)."""
        if self.proc is None:
            return {}
        out = {}
        for pid, cmd in stub_processes(self.proc.pid).items():
            args = cmd.split()
            out[pid] = args[8] if len(args) > 8 else Path(args[1]).parts[-3] if len(args) > 1 else "?"
        return out

    def fault(self) -> Optional[str]:
        """What is broken, in one sentence, or None: tritonserver gone, or a model process it had (when it was ready,
        or any seen since) dead. Triton itself notices neither: a dead stub's requests are never answered, every new
        one fails with "Stub process ... is not healthy", and its health endpoints keep answering ready."""
        rc = self.poll()
        alive = self.model_processes()  # its stubs keep its process group after it is gone
        dead = sorted(f"{name} (pid {pid})" for pid, name in self._expected.items() if pid not in alive)
        if rc is not None:
            # tritonserver (2.51) can crash (SIGSEGV) when a stub dies under it, before the stub's death is seen:
            # the stubs gone by now are named too (the one that died first, or the ones that followed the server)
            return f"tritonserver exited with status {rc}" + (f", model process {', '.join(dead)} gone" if dead else "")
        self._expected.update(alive)
        return f"model process {', '.join(dead)} died" if dead else None

    def restart(self) -> float:
        """Kill the server and everything it started at once (their clients' connections close, so every request
        in flight gets an error now instead of never), then start it again; returns the seconds until ready."""
        t0 = time.monotonic()
        self.kill()
        self.start()
        return time.monotonic() - t0

    def kill(self) -> dict:
        """Stop at once: SIGKILL the server's process group (no drain, no unload: a dead stub would hold those up,
        and a stub killed in a forced exit can crash), remove the shm regions."""
        if self.proc is not None:
            _signal(-self.proc.pid, signal.SIGKILL)  # the whole group: the server started it as its own session
            self.proc.wait()
        return self.stop(graceful=False)

    # ---- stop ------------------------------------------------------------------------------------------------
    def drain(self, timeout: float = 5.0) -> None:
        """End every open request with a final response (the engine model's DRAIN_REQUEST_ID stop request)."""
        if not (self.repo / ENGINE_MODEL / "1" / "model.py").is_file():
            return  # only the torch engine model understands the drain request
        import tritonclient.grpc as grpcclient

        done = threading.Event()
        client = grpcclient.InferenceServerClient(self.grpc_url)
        try:
            inputs = []
            for name, arr in (("input_ids", np.zeros((1, 1), np.int32)),
                              ("request_output_len", np.ones((1, 1), np.int32)),
                              ("stop", np.ones((1, 1), bool))):
                t = grpcclient.InferInput(name, list(arr.shape), "BOOL" if arr.dtype == bool else "INT32")
                t.set_data_from_numpy(arr)
                inputs.append(t)
            client.start_stream(callback=lambda result, error: done.set())
            client.async_stream_infer(ENGINE_MODEL, inputs, request_id=DRAIN_REQUEST_ID,
                                      enable_empty_final_response=True)
            if not done.wait(timeout):
                logger.warning("the drain request got no answer within %.0f s", timeout)
            client.stop_stream()
        except Exception as e:  # a server already going down; SIGINT and the kill below still run
            logger.warning("drain request failed: %s", e)
        finally:
            client.close()

    def stop(self, graceful: bool = True) -> dict:
        """Drain, SIGINT, kill stragglers, remove shm regions. Returns what had to be cleaned up. Not `graceful`
        (kill(), before a restart): the server is gone already; clean up after it, and keep the backend directory
        for the next start."""
        report = {"killed": [], "removed_shm": [], "returncode": None}
        if self.proc is not None:
            pgid = self.proc.pid
            if self.proc.poll() is None:
                self.drain()
                time.sleep(0.3)  # let the final responses reach clients before the endpoints close
            self._interrupt(self.exit_timeout + 10)
            report["killed"] = self._kill_group(pgid)
            report["returncode"] = self._reap()
        for p in glob.glob(f"/dev/shm/{self.shm_prefix}*"):
            try:
                os.unlink(p)
                report["removed_shm"].append(p)
            except FileNotFoundError:
                pass
        if not graceful:
            return report
        # keep the log of a server that failed (errors quote its path)
        shutil.rmtree(self._tmp if report["returncode"] == 0 else self._tmp / "backends", ignore_errors=True)
        if report["killed"] or report["removed_shm"]:
            logger.warning("cleaned up after tritonserver: %s", report)
        return report

    @staticmethod
    def _kill_group(pgid: int, grace: float = 3.0) -> list[int]:
        """SIGTERM, then SIGKILL, whatever is left in the server's process group (stubs, mpirun followers)."""
        left = group_members(pgid)
        if not left:
            return []
        for pid in left:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in group_members(pgid):
            _signal(pid, signal.SIGKILL)
        return left


class Supervisor:
    """Restarts a TritonServer whose model process or server died, at most `max_restarts` times in `window_s`.
    `check()` (call it every WATCH_PERIOD_S): None while healthy or once healed, else why it gave up."""

    WATCH_PERIOD_S = 0.5
    WINDOW_S = 600

    def __init__(self, server: TritonServer, max_restarts: int, window_s: float = WINDOW_S):
        self.server, self.max_restarts, self.window_s = server, max_restarts, window_s
        self.restarts: list[float] = []  # monotonic times of the restarts within the window
        self.recoveries: list[float] = []  # seconds from fault seen to ready again, every restart

    def check(self) -> Optional[str]:
        fault = self.server.fault()
        if fault is None:
            return None
        now = time.monotonic()
        self.restarts = [t for t in self.restarts if now - t <= self.window_s]
        if len(self.restarts) >= self.max_restarts:
            why = (f"{fault}; tritonserver was restarted {len(self.restarts)} time(s) in the last "
                   f"{self.window_s / 60:.0f} minutes (--max-restarts {self.max_restarts}): giving up")
            logger.error("%s. Its log ends with:\n%s", why, self.server.log_tail())
            self.server.kill()
            return why
        self.restarts.append(now)
        logger.error("%s: restarting tritonserver (%d of at most %d in %.0f minutes); requests in flight get an "
                     "error, health is not ready until it is back", fault, len(self.restarts), self.max_restarts,
                     self.window_s / 60)
        self.recoveries.append(self.server.restart())
        logger.warning("tritonserver restarted in %.1f s after: %s", self.recoveries[-1], fault)
        return None


def repo_engine(repo: Path) -> tuple[str, int]:
    """(engine model's backend, ranks to launch) of a repository: ("python", 1) for the torch engine model (it
    starts its own follower ranks), ("tensorrtllm", tp) for TensorRT-LLM's C++ backend (one server per rank)."""
    cfg = repo / ENGINE_MODEL / "config.pbtxt"
    text = cfg.read_text() if cfg.is_file() else ""
    m = re.search(r'^\s*backend:\s*"([^"]+)"', text, re.M)
    if m is None or m.group(1) != "tensorrtllm":
        return (m.group(1) if m else ""), 1
    from ..checkpoint.engine_config import load_engine_config
    from .repo import repo_parameter

    path = repo_parameter(repo, ENGINE_MODEL, "gpt_model_path")
    if path is None:
        raise UserError(f"{cfg} has no gpt_model_path parameter; remake the repository with `trt-redrafter make-repo`.")
    return "tensorrtllm", load_engine_config(path).tp_size


def require_tensorrtllm_backend(binary: Path, bundled: bool) -> Path:
    """TensorRT-LLM's Triton backend next to `binary`, or one UserError saying where to get it."""
    backend = binary.parents[1] / "backends" / "tensorrtllm"
    if bundled or not backend.is_dir():
        raise UserError(f"this repository's tensorrt_llm model runs on TensorRT-LLM's Triton backend, which "
                        f"{binary} does not have ({backend} is missing); serve it inside NVIDIA's container "
                        f"nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3 (docs/tensorrt-llm.md lists the "
                        f"tags of TensorRT-LLM 1.0-1.2).")
    return backend


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group `pgid`, from /proc."""
    out = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        state, pg = fields[0], int(fields[2])
        if pg == pgid and state != "Z":
            out.append(int(stat.split("/")[2]))
    return out


def stub_processes(pgid: int) -> dict[int, str]:
    """{pid: command line} of the Python-backend stub processes among a server's process group `pgid` (each stub's
    first argument is the model.py it serves)."""
    out = {}
    for pid in group_members(pgid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "triton_python_backend_stub" in cmd:
            out[pid] = cmd.strip()
    return out


def kernel_log() -> Optional[list[str]]:
    """The kernel log's lines (`dmesg`), or None where it cannot be read. A stub that crashes while tritonserver
    unloads it shows up only there: tritonserver exits 0 and logs nothing."""
    try:
        r = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.splitlines() if r.returncode == 0 else None


def kernel_log_since(before: Optional[list[str]]) -> Optional[list[str]]:
    """Kernel-log lines written since `before` (a `kernel_log()`; all of them if the log wrapped); None where it
    cannot be read."""
    after = kernel_log()
    if before is None or after is None:
        return None
    return after[len(before):] if after[:len(before)] == before else after


def parse_host_port(url: str, default_port: int) -> tuple[str, int]:
    m = re.fullmatch(r"(?:\w+://)?([^:/]+)(?::(\d+))?/?", url)
    if not m:
        raise UserError(f"--url {url!r} is not HOST:PORT.")
    return m.group(1), int(m.group(2) or default_port)
