"""Read an Apple ml-recurrent-drafter drafter directory: `config.json` + `model.safetensors` (else `model.pt`).

Returns a `DrafterConfig` and the tensors under canonical Apple names (shapes as nn.Linear `[out, in]`,
nb = num_draft_layers):

    input_proj.weight [exit_dim, 2H], input_proj.bias [exit_dim]      only when exit_dim != 2H
    lm_head.{j}.linear.weight [exit_dim, exit_dim], .bias [exit_dim]   j < num_draft_layers (ResBlocks)
    lm_head.{N}.weight [V, exit_dim]                                   N = num_draft_layers, no bias
    rnn_u.weight [H, H], rnn_u.bias [H], rnn_w.weight [H, H]           only when rnn

A drafter with a frequency-ranked draft vocabulary (FR-Spec, arXiv 2502.14856; written by `train-drafter
--draft-vocab K`, this project's extension of the format) has `"draft_vocab_size": K` in config.json, its
lm_head.{N}.weight is [K, exit_dim] and `draft_vocab` [K] (integer) holds the token id of each head row: the
drafter proposes only those tokens. Apple's code and TensorRT-LLM cannot load such a drafter.

Like TensorRT-LLM's `hf_drafter`, the alternative prefixes `input_projs.*`, `lm_heads.{j}.*` and `0.{j}.*` are
accepted; unlike it, a prefix is chosen only when its tensors are present (TensorRT-LLM takes the first candidate
even when absent). The structure is checked here; agreement with the base model is checked by the converter.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..config import DrafterConfig
from ..errors import UserError
from ..fsutil import read_json
from ..log import get_logger

log = get_logger(__name__)

MODEL_TYPE = "recurrent_drafting_drafter"
# canonical prefix -> prefixes TensorRT-LLM accepts for it, in its order ({j} is a layer index)
INPUT_PROJ_PREFIXES = ("input_proj", "input_projs")
LM_HEAD_PREFIXES = ("lm_head.{j}", "lm_heads.{j}", "0.{j}")


@dataclass
class DrafterCheckpoint:
    path: Path
    config: DrafterConfig
    tensors: dict[str, torch.Tensor]  # canonical Apple names, as stored (dtype unchanged)


def drafter_config_from_json(raw: dict, where: str) -> DrafterConfig:
    """A `DrafterConfig` from Apple's config.json (generic HF keys are ignored, as TensorRT-LLM does)."""
    missing = [k for k in ("vocab_size", "hidden_size", "exit_dim", "num_draft_layers") if k not in raw]
    if missing:
        raise UserError(f"{where}: missing key(s) {', '.join(missing)}; is this an Apple recurrent drafter config?")
    keys = ("vocab_size", "hidden_size", "exit_dim", "num_draft_layers", "rnn", "draft_vocab_size")
    return DrafterConfig.from_dict({k: raw[k] for k in keys if k in raw}, where=where)


def _load_tensors(path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    st, pt = path / "model.safetensors", path / "model.pt"
    if st.is_file():
        try:
            return st, load_file(str(st), device="cpu")
        except (OSError, SafetensorError) as e:
            raise UserError(f"cannot read drafter weights {st}: {e}.") from e
    if pt.is_file():
        try:
            sd = torch.load(pt, map_location="cpu", weights_only=True)
        except (OSError, RuntimeError, pickle.UnpicklingError) as e:
            raise UserError(f"cannot read drafter weights {pt} (loaded as weights only): {e}.") from e
        if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
            raise UserError(f"{pt} must hold a state dict of tensors.")
        return pt, dict(sd)
    raise UserError(f"drafter directory {path} has no weights: expected model.safetensors or model.pt.")


def _pick(stored: dict[str, torch.Tensor], candidates: list[str], suffixes: tuple[str, ...]) -> str:
    """The first candidate prefix whose `prefix.suffix` tensors are all stored; the first candidate if none is."""
    for c in candidates:
        if all(f"{c}.{s}" in stored for s in suffixes):
            return c
    return candidates[0]


def canonicalize(stored: dict[str, torch.Tensor], cfg: DrafterConfig, where: str) -> dict[str, torch.Tensor]:
    """Map stored names to canonical ones and check presence, flags and shapes; raise naming what is wrong."""
    h, e, n = cfg.hidden_size, cfg.exit_dim, cfg.num_draft_layers
    has_proj = any(k.startswith(p + ".") for p in INPUT_PROJ_PREFIXES for k in stored)
    if cfg.has_input_proj and not has_proj:
        raise UserError(f"{where}: exit_dim={e} differs from 2*hidden_size={2 * h}, so the drafter needs input_proj "
                        f"weights, but none are stored; check exit_dim in config.json.")
    if not cfg.has_input_proj and has_proj:
        raise UserError(f"{where}: input_proj weights are stored but exit_dim={e} equals 2*hidden_size, so "
                        f"TensorRT-LLM would ignore them; check exit_dim in config.json.")
    has_rnn = [k for k in ("rnn_u.weight", "rnn_u.bias", "rnn_w.weight") if k in stored]
    if cfg.rnn and len(has_rnn) < 3:
        missing = sorted({"rnn_u.weight", "rnn_u.bias", "rnn_w.weight"} - set(has_rnn))
        raise UserError(f"{where}: config.json says rnn=true but tensor(s) {', '.join(missing)} are missing.")
    if not cfg.rnn and has_rnn:
        raise UserError(f"{where}: config.json says rnn=false but rnn_u/rnn_w tensors are stored; "
                        f"set rnn=true or use the matching drafter.")

    want: dict[str, tuple[str, tuple[int, ...]]] = {}  # canonical -> (stored name, shape)
    if cfg.has_input_proj:
        p = _pick(stored, list(INPUT_PROJ_PREFIXES), ("weight", "bias"))
        want["input_proj.weight"] = (f"{p}.weight", (e, 2 * h))
        want["input_proj.bias"] = (f"{p}.bias", (e,))
    for j in range(n):
        p = _pick(stored, [c.format(j=j) + ".linear" for c in LM_HEAD_PREFIXES], ("weight", "bias"))
        want[f"lm_head.{j}.linear.weight"] = (f"{p}.weight", (e, e))
        want[f"lm_head.{j}.linear.bias"] = (f"{p}.bias", (e,))
    p = _pick(stored, [c.format(j=n) for c in LM_HEAD_PREFIXES], ("weight",))
    want[f"lm_head.{n}.weight"] = (f"{p}.weight", (cfg.head_rows, e))
    if cfg.draft_vocab_size:
        want["draft_vocab"] = ("draft_vocab", (cfg.draft_vocab_size,))
    elif "draft_vocab" in stored:
        raise UserError(f"{where}: a draft_vocab tensor is stored but config.json has no draft_vocab_size; set "
                        f"draft_vocab_size to its length ({stored['draft_vocab'].numel()}) or remove it.")
    if cfg.rnn:
        want.update({"rnn_u.weight": ("rnn_u.weight", (h, h)), "rnn_u.bias": ("rnn_u.bias", (h,)),
                     "rnn_w.weight": ("rnn_w.weight", (h, h))})

    absent = [s for s, _ in want.values() if s not in stored]
    if absent:
        raise UserError(f"{where}: missing drafter tensor(s) {', '.join(absent)} "
                        f"(config.json: num_draft_layers={n}, exit_dim={e}, rnn={str(cfg.rnn).lower()}).")
    out = {}
    for canon, (name, shape) in want.items():
        t = stored[name]
        if tuple(t.shape) != shape:
            raise UserError(f"{where}: tensor {name} has shape {list(t.shape)}, expected {list(shape)} from "
                            f"config.json (vocab_size={cfg.vocab_size}, hidden_size={h}, exit_dim={e}"
                            + (f", draft_vocab_size={cfg.draft_vocab_size}" if cfg.draft_vocab_size else "") + ").")
        out[canon] = t
    if cfg.draft_vocab_size:
        check_draft_vocab(out["draft_vocab"], cfg.vocab_size, where)
    unused = sorted(set(stored) - {s for s, _ in want.values()})
    if unused:
        log.warning("%s: ignoring %d tensor(s) the drafter does not use: %s", where, len(unused),
                    ", ".join(unused[:8]))
    return out


def check_draft_vocab(ids: torch.Tensor, vocab_size: int, where: str) -> None:
    """A draft vocabulary is distinct integer token ids of the base's vocabulary."""
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise UserError(f"{where}: draft_vocab must hold integer token ids, got dtype {ids.dtype}.")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise UserError(f"{where}: draft_vocab holds token ids outside the vocabulary [0, {vocab_size}).")
    if torch.unique(ids).numel() != ids.numel():
        raise UserError(f"{where}: draft_vocab repeats token ids; each head row must name a distinct token.")


def read_drafter(path: str | Path) -> DrafterCheckpoint:
    """Open an Apple-format drafter directory, checked for internal consistency."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"drafter directory {path} does not exist.")
    raw = read_json(path / "config.json", "drafter config")
    mt = raw.get("model_type")
    if mt is not None and mt != MODEL_TYPE:
        raise UserError(f"{path / 'config.json'}: model_type is {mt!r}, expected {MODEL_TYPE!r} (an Apple recurrent "
                        f"drafter); did you swap --base-model and --drafter?")
    cfg = drafter_config_from_json(raw, str(path / "config.json"))
    wfile, stored = _load_tensors(path)
    tensors = canonicalize(stored, cfg, str(wfile))
    log.info("drafter %s: %d ResBlock(s), exit_dim=%d, rnn=%s, V=%d%s", path, cfg.num_draft_layers, cfg.exit_dim,
             cfg.rnn, cfg.vocab_size, f", draft vocabulary {cfg.draft_vocab_size}" if cfg.draft_vocab_size else "")
    return DrafterCheckpoint(path, cfg, tensors)
