"""Start and stop the OpenAI frontend process next to tritonserver (`trt-redrafter serve --openai-port N`).

`with OpenAIFrontend(repo, grpc_url, port) as api:` a frontend answering on `api.url` (http://HOST:PORT/v1);
leaving the block stops it: SIGINT (uvicorn lets open requests finish for a few seconds, then cancels them and their
Triton requests), then SIGKILL to anything left in its process group. It is ready once it answers /v1/models,
whether or not Triton is (its /health says that).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional, TextIO

from ...errors import UserError
from ...log import get_logger
from ..launcher import LOG_TAIL_LINES, connect_host, group_members, package_env, pump_output, require_free_ports
from . import GRACEFUL_SHUTDOWN_S

logger = get_logger(__name__)

EXIT_MARGIN_S = 10  # beyond the graceful shutdown, before the frontend is killed


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


class OpenAIFrontend:
    def __init__(self, repo: str | Path, grpc_url: str, port: int, host: str = "127.0.0.1",
                 model_name: Optional[str] = None, ready_timeout: float = 120.0, log_path: str | Path | None = None,
                 echo: Optional[TextIO] = None):
        self.repo, self.grpc_url, self.port, self.host = Path(repo).absolute(), grpc_url, port, host
        self.model_name, self.ready_timeout, self._echo = model_name, ready_timeout, echo
        self._tmp = Path(tempfile.mkdtemp(prefix="trt-redrafter-openai-"))
        self.log_path = Path(log_path) if log_path else self._tmp / "openai-frontend.log"
        self.proc: Optional[subprocess.Popen] = None
        self._pump: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        """The base URL OpenAI clients take (`openai.OpenAI(base_url=...)`)."""
        return f"http://{connect_host(self.host)}:{self.port}/v1"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "trt_redrafter.serving.openai_api", "--repo", str(self.repo),
               "--grpc-url", self.grpc_url, "--host", self.host, "--port", str(self.port)]
        return cmd + (["--model-name", self.model_name] if self.model_name else [])

    def start(self) -> "OpenAIFrontend":
        require_free_ports(self.host, {"--openai-port": self.port})
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.command(), env=package_env(), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self._pump = threading.Thread(target=pump_output, args=(self.proc.stdout, log, self._echo),
                                      name="openai-frontend-log", daemon=True)
        self._pump.start()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        t0 = time.monotonic()
        while not _answers(f"{self.url}/models"):
            if self.proc.poll() is not None:
                raise UserError(f"the OpenAI frontend exited with status {self.proc.returncode} before it was "
                                f"ready; its log ({self.log_path}) ends with:\n{self.log_tail()}")
            if time.monotonic() - t0 > self.ready_timeout:
                raise UserError(f"the OpenAI frontend did not answer within {self.ready_timeout:.0f} s; its log "
                                f"({self.log_path}) ends with:\n{self.log_tail()}")
            time.sleep(0.1)
        logger.info("OpenAI frontend ready in %.1f s at %s", time.monotonic() - t0, self.url)

    def log_tail(self, n: int = LOG_TAIL_LINES) -> str:
        time.sleep(0.2)  # let the log pump catch up
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def poll(self) -> Optional[int]:
        return None if self.proc is None else self.proc.poll()

    def stop(self) -> dict:
        """SIGINT, wait, SIGKILL what is left of its process group. Returns what had to be cleaned up."""
        report = {"returncode": None, "killed": []}
        if self.proc is None:
            return report
        pgid = self.proc.pid
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=GRACEFUL_SHUTDOWN_S + EXIT_MARGIN_S)
            except subprocess.TimeoutExpired:
                logger.warning("the OpenAI frontend did not exit within %d s; killing it",
                               GRACEFUL_SHUTDOWN_S + EXIT_MARGIN_S)
        left = group_members(pgid)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        report["returncode"], report["killed"] = self.proc.returncode, left
        if self._pump is not None:
            self._pump.join(timeout=5)
        self.proc.stdout.close()
        self.proc = None
        if report["returncode"] == 0:  # keep the log of a frontend that failed (errors quote its path)
            shutil.rmtree(self._tmp, ignore_errors=True)
        if left:
            logger.warning("cleaned up after the OpenAI frontend: %s", report)
        return report

    def __enter__(self) -> "OpenAIFrontend":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
