"""Import a Llama, Qwen2 or Qwen3 GGUF (llama.cpp's one-file format) as a plain Hugging Face directory.

transformers does the reading (`from_pretrained(dir, gguf_file=name)`): it dequantizes every tensor, undoes the
rotary row permutation llama.cpp's converter applies to a Llama's `attn_q`/`attn_k` (`LlamaModel.permute` in
llama.cpp's `convert_hf_to_gguf.py`; Qwen's rows are stored unpermuted), and rebuilds the tokenizer from the
`tokenizer.ggml.*` metadata (a Qwen2 GGUF's `tokenizer.ggml.pre = qwen2` selects Qwen's pre-tokenizer split). This
module adds what a user needs around that: refusals raised before the slow part (missing file, not a GGUF, an
architecture this project does not run, output exists), an output that appears only when complete, and the chat
template carried over.

Layout written under OUT (the usual `save_pretrained` files):
    config.json              model_type llama, qwen2 or qwen3; tie_word_embeddings true when the GGUF has no
                             `output.weight`
    generation_config.json   bos/eos/pad ids from the GGUF
    model.safetensors        or model-0000N-of-0000M.safetensors + model.safetensors.index.json
    tokenizer.json, tokenizer_config.json, chat_template.jinja (or the template inside tokenizer_config.json)

The GGUF's extra named templates (`tokenizer.chat_template.<name>`, e.g. tool_use) are not carried over.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from ..config import DTYPES, torch_dtype
from ..errors import UserError, require
from ..families import FAMILIES
from ..fsutil import atomic_output_dir
from ..log import get_logger
from .tokenizer_files import save_tokenizer

log = get_logger(__name__)

# GGUF `general.architecture` -> the Hugging Face model_type it becomes (families.py)
SUPPORTED_ARCHITECTURES = tuple(f.model_type for f in FAMILIES)
DEFAULT_DTYPE = "float32"  # dequantized GGUF values (fp16 scale x small int) are exact in fp32; fp16/bf16 round them
MAX_SHARD_SIZE = "5GB"  # safetensors shard size, as the Hugging Face Hub's own uploads use
INSTALL_HINT = "pip install 'trt-redrafter[gguf]'"
# What the gguf reader raises on a file that is not a (complete) GGUF: bad magic, truncated arrays, missing keys.
_READ_ERRORS = (OSError, ValueError, IndexError, KeyError)
# What transformers raises on a GGUF it cannot turn into a model: unsupported tokenizer or quantization type, ...
_LOAD_ERRORS = (OSError, ValueError, KeyError, NotImplementedError)


@dataclass(frozen=True)
class GGUFInfo:
    """The few metadata fields checked before loading the weights."""

    path: Path
    architecture: str  # general.architecture, e.g. "llama"
    name: str | None  # general.name
    chat_template: str | None  # tokenizer.chat_template
    tensor_count: int


def _string_field(reader, key: str) -> str | None:
    """A string-valued GGUF metadata field, None when absent (the layout transformers' `read_field` also reads)."""
    field = reader.fields.get(key)
    if field is None or not field.data:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def read_gguf_info(path: str | Path) -> GGUFInfo:
    """Open `path` with `gguf.GGUFReader` (metadata and tensor index only; the data stays memory-mapped)."""
    path = Path(path)
    require(path.exists(), f"GGUF file {path} does not exist; pass the path of a .gguf file with --gguf.")
    require(path.is_file(), f"{path} is not a file; pass the .gguf file itself with --gguf, not its directory.")
    try:
        from gguf import GGUFReader
    except ImportError as e:
        raise UserError(f"reading GGUF files needs the `gguf` package, which is not installed; "
                        f"run {INSTALL_HINT}.") from e
    try:
        reader = GGUFReader(path)
        architecture = _string_field(reader, "general.architecture")
        info = GGUFInfo(path=path, architecture=architecture or "", name=_string_field(reader, "general.name"),
                        chat_template=_string_field(reader, "tokenizer.chat_template"),
                        tensor_count=len(reader.tensors))
    except _READ_ERRORS as e:
        raise UserError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e}); check that the file is a "
                        f"complete llama.cpp .gguf (re-download it if it was cut short).") from e
    require(architecture is not None, f"{path} has no general.architecture metadata key, so it is not a model GGUF "
                                      f"llama.cpp would load; pass a GGUF of a Llama model.")
    return info


def import_gguf(gguf_path: str | Path, output: str | Path, dtype: str = DEFAULT_DTYPE, force: bool = False) -> Path:
    """Write the GGUF `gguf_path` as a Hugging Face directory `output` with weights in `dtype`."""
    require(dtype in DTYPES, f"--dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}.")
    info = read_gguf_info(gguf_path)
    require(info.architecture in SUPPORTED_ARCHITECTURES,
            f"{info.path} is a {info.architecture!r} GGUF (general.architecture), but import-gguf reads only "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} models; pass the GGUF of a model of one of those architectures.")
    require(importlib.util.find_spec("accelerate") is not None,
            f"loading GGUF weights with transformers needs the `accelerate` package, which is not installed; "
            f"run {INSTALL_HINT}.")
    with atomic_output_dir(output, force=force, what="import-gguf output") as tmp:
        _check_model_type(info)
        tokenizer = _load_tokenizer(info)
        model = _load_model(info, dtype)
        log.info("writing %s (%s, %d layers, tie_word_embeddings=%s)", output, dtype, model.config.num_hidden_layers,
                 model.config.tie_word_embeddings)
        model.save_pretrained(tmp, max_shard_size=MAX_SHARD_SIZE)
        save_tokenizer(tokenizer, tmp)  # loadable by transformers 4.5x (TensorRT-LLM containers) and 5.x
        _check_written(tmp, info, tie=bool(model.config.tie_word_embeddings))
    log.info("imported %s -> %s", info.path, output)
    return Path(output)


def _pretrained_args(info: GGUFInfo) -> tuple[str, dict]:
    return str(info.path.parent), {"gguf_file": info.path.name}


def _load_error(info: GGUFInfo, what: str, e: Exception) -> UserError:
    import transformers

    return UserError(f"transformers {transformers.__version__} could not read the {what} of {info.path} "
                     f"({type(e).__name__}: {e}); check that the GGUF is complete and uses a tokenizer and "
                     f"quantization types transformers supports, or upgrade transformers and gguf.")


def _check_model_type(info: GGUFInfo) -> None:
    """transformers maps some GGUFs to another model (a `llama` one whose general.name contains "mistral" loads as
    Mistral)."""
    from transformers import AutoConfig

    where, kw = _pretrained_args(info)
    try:
        config = AutoConfig.from_pretrained(where, **kw)
    except _LOAD_ERRORS as e:
        raise _load_error(info, "config", e) from e
    require(config.model_type == info.architecture,
            f"transformers reads {info.path} (general.name {info.name!r}) as a {config.model_type!r} model, not "
            f"{info.architecture!r}; import-gguf writes only {', '.join(SUPPORTED_ARCHITECTURES)} directories, so "
            f"pass a plain GGUF of one of those.")


def _load_tokenizer(info: GGUFInfo):
    from transformers import AutoTokenizer

    where, kw = _pretrained_args(info)
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, **kw)
    except _LOAD_ERRORS as e:
        raise _load_error(info, "tokenizer", e) from e
    if info.chat_template is not None and tokenizer.chat_template != info.chat_template:
        # older transformers leave tokenizer.chat_template out of the GGUF tokenizer; the saved one must carry it
        tokenizer.chat_template = info.chat_template
    return tokenizer


def _load_model(info: GGUFInfo, dtype: str):
    """The GGUF as a dense HF causal LM (Llama, Qwen2, Qwen3) in `dtype`, detached from transformers' GGUF
    quantizer."""
    from transformers import AutoModelForCausalLM

    where, kw = _pretrained_args(info)
    try:
        from transformers import GgufConfig
    except ImportError:
        pass  # transformers without GgufConfig always dequantizes GGUF weights at load time
    else:
        # newer transformers keep quantized blocks packed (GgufLinear) when a matmul kernel is installed; ask for dense
        kw["quantization_config"] = GgufConfig(dequantize=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(where, dtype=torch_dtype(dtype), **kw)
    except _LOAD_ERRORS as e:
        raise _load_error(info, "weights", e) from e
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        # the weights are plain tensors now; without this, save_pretrained refuses ("not serializable") and
        # config.json would ask the next loader for the GGUF file again
        quantizer.remove_quantization_config(model)
    odd = {n: (str(p.dtype), str(p.device), type(p).__name__) for n, p in model.named_parameters()
           if p.dtype != torch_dtype(dtype) or p.device.type != "cpu" or type(p).__name__ != "Parameter"}
    assert not odd, f"not dense {dtype} CPU parameters after loading {info.path}: {odd}"
    assert model.config.model_type == info.architecture, model.config.model_type
    return model.eval()


def _check_written(out: Path, info: GGUFInfo, tie: bool) -> None:
    """Cheap reload of what was written (config and tokenizer; the weights were just written by save_pretrained)."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(out)
    assert config.model_type == info.architecture, config.model_type
    assert getattr(config, "quantization_config", None) is None, config.quantization_config
    assert bool(config.tie_word_embeddings) == tie, (config.tie_word_embeddings, tie)
    if info.chat_template is not None:
        reloaded = AutoTokenizer.from_pretrained(out).chat_template
        assert reloaded == info.chat_template, ("chat template lost on save", reloaded, info.chat_template)
