"""`make-repo`: a Triton model repository from the templates in `trt_redrafter/triton_repo/` (package data) and an
engine's `config.json`.

Templates use `${name}` placeholders (TensorRT-LLM's fill_template.py syntax). Unlike fill_template's
`safe_substitute`, a placeholder left unfilled is an error naming the file, never a literal that the server
later fails to parse or silently defaults. Every value comes from the engine's config.json (batch size, TP,
sequence limits) or the command line (paths), so nothing is stated twice.

Layout written (REPO):
    ensemble/config.pbtxt
    preprocessing/{config.pbtxt, 1/model.py, 1/trt_redrafter/}
    postprocessing/{config.pbtxt, 1/model.py, 1/trt_redrafter/}
    tensorrt_llm/{config.pbtxt, 1/model.py}   torch backend: Python-backend decoupled engine model
    tensorrt_llm/{config.pbtxt, 1/}           tensorrtllm backend: TensorRT-LLM's C++ backend, decoding_mode redrafter
"""

from __future__ import annotations

import re
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..config import RuntimeConfig
from ..errors import UserError
from ..fsutil import atomic_output_dir
from ..log import get_logger
from ..checkpoint.engine_config import EngineConfig, load_engine_config
from . import ENGINE_MODEL

logger = get_logger(__name__)

REPO_BACKENDS = ("torch", "tensorrtllm")
ENGINE_BACKEND_FOR = {"torch": "torch", "tensorrtllm": "trtllm"}  # repo backend -> engine backend it serves
PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
TEXT_MODELS = ("ensemble", "preprocessing", "postprocessing", "tensorrt_llm_bls")
PACKAGE_ROOT = Path(__file__).resolve().parents[1]
# Package data (pyproject.toml [tool.setuptools.package-data]), so an installed wheel makes repositories too. Not a
# Python package: it has no __init__.py, and its `1/` directories are not importable names.
TEMPLATES = PACKAGE_ROOT / "triton_repo"
# The text models' own code, copied beside their model.py: a repository then loads in a stock tritonserver (NGC's
# -trtllm-python-py3 container has transformers and numpy, not trt-redrafter) without any PYTHONPATH.
TEXT_MODULES = ("__init__.py", "errors.py", "chat.py", "serving/__init__.py", "serving/text.py")

# torch only: a per-request `decoding_mode` ("redrafter" | "ar"; the same engine decodes either way) and `proposer`
# ("redrafter" | "ngram" | "mixed"; what drafts the request's trees, default the engine's)
_ENSEMBLE_EXTRA_INPUTS = (',\n  { name: "decoding_mode" data_type: TYPE_STRING dims: [ 1 ] optional: true }'
                          ',\n  { name: "proposer" data_type: TYPE_STRING dims: [ 1 ] optional: true }')
_ENGINE_EXTRA_INPUT_MAP = ('      input_map  { key: "decoding_mode"      value: "decoding_mode" }\n'
                           '      input_map  { key: "proposer"           value: "proposer" }')
# torch only: the engine sends the tokens preceding each response so postprocessing can detokenize incrementally,
# and its key of the request, which postprocessing sends back to cancel it when the client cancelled the ensemble
# request (Triton 2.51's ensemble marks only the steps it schedules next as cancelled, never the running engine step)
_ENGINE_EXTRA_OUTPUT_MAP = ('      output_map { key: "preceding_output_ids"        value: "_PRECEDING_TOKENS" }\n'
                            '      output_map { key: "request_key"                 value: "_REQUEST_KEY" }')
_POST_EXTRA_INPUT_MAP = ('      input_map  { key: "PRECEDING_TOKENS"            value: "_PRECEDING_TOKENS" }\n'
                         '      input_map  { key: "REQUEST_KEY"                 value: "_REQUEST_KEY" }')


@dataclass
class RepoSpec:
    engine_dir: Path
    tokenizer_dir: Path
    backend: str  # torch | tensorrtllm
    engine: EngineConfig
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)  # torch engine model: how it runs the engine
    # the engine model's transaction policy: decoupled (streaming; gRPC stream clients) or not (one response per
    # request; unary gRPC ModelInfer and HTTP infer), TensorRT-LLM's `decoupled_mode`
    decoupled: bool = True
    max_queue_size: int = 0  # requests waiting beyond the running batch before "server busy"; 0: no limit

    def values(self) -> dict[str, str]:
        """Every placeholder's value; all derived from the engine's config.json or the given paths."""
        b = self.engine.build
        torch = self.backend == "torch"
        return {
            "max_batch_size": str(b.max_batch_size),
            "decoupled": "true" if self.decoupled else "false",
            "max_queue_size": str(self.max_queue_size),
            "tp_size": str(self.engine.tp_size),
            "max_seq_len": str(b.max_seq_len),
            "engine_dir": str(self.engine_dir),
            "tokenizer_dir": str(self.tokenizer_dir),
            "ensemble_extra_inputs": _ENSEMBLE_EXTRA_INPUTS if torch else "",
            "engine_extra_input_map": _ENGINE_EXTRA_INPUT_MAP if torch else "",
            "engine_extra_output_map": _ENGINE_EXTRA_OUTPUT_MAP if torch else "",
            "postprocessing_extra_input_map": _POST_EXTRA_INPUT_MAP if torch else "",
            # a pbtxt string: JSON with its quotes escaped
            "runtime_config": json.dumps(self.runtime.to_dict(), sort_keys=True).replace('"', '\\"'),
            # TensorRT-LLM's executor: prefix reuse and chunked prefill as the torch engine's runtime flags say
            "enable_kv_cache_reuse": str(self.runtime.kv_cache_reuse).lower(),
            "enable_chunked_context": str(self.runtime.enable_chunked_context).lower(),
        }

    def header(self) -> str:
        b, rd = self.engine.build, self.engine.checkpoint.redrafter
        return (f"# Generated by `trt-redrafter make-repo` from {self.engine_dir}/config.json "
                f"(backend {self.backend}, tp={self.engine.tp_size}, max_batch_size={b.max_batch_size}, "
                f"max_input_len={b.max_input_len}, max_seq_len={b.max_seq_len}, num_beams={rd.num_beams}, "
                f"draft_len_per_beam={rd.draft_len_per_beam}, decoupled={str(self.decoupled).lower()}, "
                f"max_queue_size={self.max_queue_size}). Edit the engine, not this file.\n")


def fill(text: str, values: dict[str, str], where: str) -> str:
    """Substitute every `${name}`; an unknown name is an error naming `where`."""
    missing = sorted({m.group(1) for m in PLACEHOLDER.finditer(text)} - set(values))
    if missing:
        raise UserError(f"template {where} has placeholder(s) {', '.join('${' + m + '}' for m in missing)} that "
                        f"make-repo has no value for; fill them in the template or remove them.")
    return PLACEHOLDER.sub(lambda m: values[m.group(1)], text)


def repo_parameter(repo: str | Path, model: str, key: str) -> str | None:
    """A string parameter of one model's config.pbtxt in a repository (`parameters { key: "K" value: { string_value:
    "V" } }`), None where the model or the key is absent."""
    cfg = Path(repo) / model / "config.pbtxt"
    text = cfg.read_text() if cfg.is_file() else ""
    m = re.search(r'key:\s*"' + re.escape(key) + r'"\s*value:\s*\{\s*string_value:\s*"((?:[^"\\]|\\.)*)"', text)
    return None if m is None else re.sub(r"\\(.)", r"\1", m.group(1))


def resolve_spec(engine_dir: str | Path, tokenizer_dir: str | Path | None = None,
                 backend: str | None = None, runtime: RuntimeConfig | None = None, decoupled: bool = True,
                 max_queue_size: int = 0) -> RepoSpec:
    if max_queue_size < 0:
        raise UserError(f"--max-queue-size must be >= 0 (0: no limit), got {max_queue_size}.")
    engine_dir = Path(engine_dir).absolute()
    ecfg = load_engine_config(engine_dir)
    default = {"torch": "torch", "trtllm": "tensorrtllm"}[ecfg.backend]
    backend = backend or default
    if backend not in REPO_BACKENDS:
        raise UserError(f"--backend must be one of {', '.join(REPO_BACKENDS)}, got {backend!r}.")
    if ENGINE_BACKEND_FOR[backend] != ecfg.backend:
        raise UserError(f"engine {engine_dir} was built for the {ecfg.backend} backend but --backend {backend} "
                        f"serves {ENGINE_BACKEND_FOR[backend]} engines; omit --backend or rebuild with "
                        f"`build-engine --backend {ENGINE_BACKEND_FOR[backend]}`.")
    tok = Path(tokenizer_dir).absolute() if tokenizer_dir else engine_dir / "tokenizer"
    if not tok.is_dir():
        raise UserError(f"tokenizer directory {tok} does not exist; build the engine with --tokenizer or pass "
                        f"--tokenizer DIR.")
    return RepoSpec(engine_dir, tok, backend, ecfg, runtime or RuntimeConfig(), decoupled, max_queue_size)


def template_files(backend: str, templates: Path = TEMPLATES) -> dict[str, Path]:
    """Repository-relative path -> template file, for one backend."""
    if not (templates / "ensemble" / "config.pbtxt").is_file():
        raise UserError(f"the Triton templates are missing from {templates}; this trt-redrafter was installed "
                        f"without its package data: reinstall it (pip install trt-redrafter, or pip install -e . "
                        f"from a checkout).")
    files = {}
    for model in TEXT_MODELS:
        for p in sorted((templates / model).rglob("*")):
            if p.is_file() and "__pycache__" not in p.parts:
                files[str(p.relative_to(templates))] = p
    eng = templates / ENGINE_MODEL
    if backend == "torch":
        files[f"{ENGINE_MODEL}/config.pbtxt"] = eng / "config.pbtxt"
        files[f"{ENGINE_MODEL}/1/model.py"] = eng / "1" / "model.py"
    else:
        files[f"{ENGINE_MODEL}/config.pbtxt"] = eng / "config.tensorrtllm.pbtxt"
    return files


def render(spec: RepoSpec, templates: Path = TEMPLATES) -> dict[str, str]:
    """Repository-relative path -> file text. Config files are filled; model.py files are copied unchanged."""
    values = spec.values()
    out = {}
    for rel, src in template_files(spec.backend, templates).items():
        text = src.read_text()
        if src.suffix == ".pbtxt":
            text = spec.header() + fill(text, values, str(src))
        out[rel] = text
    for model in ("preprocessing", "postprocessing"):
        for mod in TEXT_MODULES:
            out[f"{model}/1/trt_redrafter/{mod}"] = (PACKAGE_ROOT / mod).read_text()
    return out


def make_repo(engine_dir: str | Path, output: str | Path, tokenizer_dir: str | Path | None = None,
              backend: str | None = None, force: bool = False, templates: Path = TEMPLATES,
              runtime: RuntimeConfig | None = None, decoupled: bool = True, max_queue_size: int = 0) -> RepoSpec:
    spec = resolve_spec(engine_dir, tokenizer_dir, backend, runtime, decoupled, max_queue_size)
    files = render(spec, templates)  # every template is filled before anything is written
    with atomic_output_dir(output, force=force, what="model repository") as tmp:
        for rel, text in files.items():
            path = tmp / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        for model in (*TEXT_MODELS, ENGINE_MODEL):  # Triton loads only models with a version directory
            (tmp / model / "1").mkdir(parents=True, exist_ok=True)
    logger.info("wrote Triton model repository %s (%s backend, engine %s)", output, spec.backend, spec.engine_dir)
    return spec

