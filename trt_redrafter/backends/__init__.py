"""Engine builders. `torch` (this project's runtime, everywhere) and `trtllm` (TensorRT-LLM, where installed)."""

from __future__ import annotations

import importlib.util

from ..checkpoint.engine_config import BACKENDS  # noqa: F401  (the engine directory's schema names them)


def trtllm_available() -> bool:
    return importlib.util.find_spec("tensorrt_llm") is not None


def default_backend() -> str:
    return "trtllm" if trtllm_available() else "torch"
