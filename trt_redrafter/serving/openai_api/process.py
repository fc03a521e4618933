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
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional, TextIO

from ...log import get_logger
from ..launcher import ChildProcess, connect_host, group_members, package_env, require_free_ports
from . import GRACEFUL_SHUTDOWN_S

logger = get_logger(__name__)

EXIT_MARGIN_S = 10  # beyond the graceful shutdown, before the frontend is killed


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


class OpenAIFrontend(ChildProcess):
    NAME = "the OpenAI frontend"

    def __init__(self, repo: str | Path, grpc_url: str, port: int, host: str = "127.0.0.1",
                 model_name: Optional[str] = None, ready_timeout: float = 120.0, log_path: str | Path | None = None,
                 echo: Optional[TextIO] = None):
        self.repo, self.grpc_url, self.port, self.host = Path(repo).absolute(), grpc_url, port, host
        self.model_name = model_name
        super().__init__("trt-redrafter-openai-", "openai-frontend.log", log_path, echo, ready_timeout)

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
        self._spawn(self.command(), package_env())
        try:
            waited = self._wait_ready(lambda: _answers(f"{self.url}/models"))
        except BaseException:
            self.stop()
            raise
        logger.info("OpenAI frontend ready in %.1f s at %s", waited, self.url)
        return self

    def stop(self) -> dict:
        """SIGINT, wait, SIGKILL what is left of its process group. Returns what had to be cleaned up."""
        report = {"returncode": None, "killed": []}
        if self.proc is None:
            return report
        pgid = self.proc.pid
        self._interrupt(GRACEFUL_SHUTDOWN_S + EXIT_MARGIN_S)
        left = group_members(pgid)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        report["returncode"], report["killed"] = self._reap(), left
        if report["returncode"] == 0:  # keep the log of a frontend that failed (errors quote its path)
            shutil.rmtree(self._tmp, ignore_errors=True)
        if left:
            logger.warning("cleaned up after the OpenAI frontend: %s", report)
        return report
