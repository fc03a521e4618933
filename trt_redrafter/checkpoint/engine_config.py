"""The engine directory's `config.json`, shaped like TensorRT-LLM's: `version`, `pretrained_config`, `build_config`.

`pretrained_config` is the checkpoint's config unchanged; `build_config` carries the limits `trtllm-build`
names (max_batch_size, max_input_len, max_seq_len, max_num_tokens, max_beam_width, max_draft_len,
speculative_decoding_mode) plus this project's `backend`, torch-backend settings and `speculation`: the tree shape
of a base without a drafter (num_beams, draft_len_per_beam, from the build flags; a ReDrafter checkpoint's shape is
its `redrafter_*` keys in `pretrained_config`, stored once there) and the proposer settings (config.ProposerConfig).
Serving templates read their values from here, so nothing is stated twice.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from .. import __version__
from .trtllm_config import CheckpointInfo, parse_checkpoint_config
from ..config import BuildConfig, ProposerConfig, ReDrafterConfig
from ..errors import UserError
from ..fsutil import read_json

BACKENDS = ("torch", "trtllm")


@dataclass
class EngineConfig:
    checkpoint: CheckpointInfo
    build: BuildConfig
    backend: str
    version: str
    raw: dict
    tree: ReDrafterConfig  # the draft-tree shape every speculative step verifies
    proposer: ProposerConfig  # resolved: an explicit default proposer and mixed split

    @property
    def tp_size(self) -> int:
        return self.checkpoint.tp_size

    @property
    def has_drafter(self) -> bool:
        return self.checkpoint.drafter is not None

    def shape_key(self) -> str:
        """What identifies the engine's step costs (runtime/costs.py): its shapes, limits and tree, as JSON."""
        ck = self.checkpoint
        return json.dumps({"build": self.build.to_dict(), "tree": self.tree.to_dict(), "model": ck.model.to_dict(),
                           "drafter": ck.drafter.to_dict() if ck.drafter else None}, sort_keys=True)


def engine_config_dict(info: CheckpointInfo, build: BuildConfig, backend: str,
                       tree: ReDrafterConfig | None = None, proposer: ProposerConfig | None = None) -> dict:
    """`tree` is required for a base without a drafter (a ReDrafter checkpoint fixes its own)."""
    rd = info.redrafter or tree
    if rd is None:
        raise UserError("this checkpoint has no drafter; give the tree shape (--num-beams, --draft-len-per-beam) "
                        "for the N-gram proposers.")
    proposer = (proposer or ProposerConfig()).resolved(info.drafter is not None, rd.num_beams)
    build_config = {
        **build.to_dict(),
        "max_num_tokens": build.resolved_max_num_tokens(rd),
        "max_beam_width": 1,  # ReDrafter's beams are drafts, not output beams (TensorRT-LLM requires 1)
        "max_draft_len": rd.max_draft_tokens,
        "speculative_decoding_mode": "explicit_draft_tokens",
        "kv_cache_type": "paged",
        "backend": backend,
        # the tree shape is stored once: a ReDrafter checkpoint's in pretrained_config (redrafter_*), a drafterless
        # base's (N-gram trees) here
        "speculation": {**({} if info.redrafter is not None else
                           {"num_beams": rd.num_beams, "draft_len_per_beam": rd.draft_len_per_beam}),
                        **proposer.to_dict()},
    }
    return {"version": f"trt-redrafter {__version__}", "pretrained_config": info.raw, "build_config": build_config}


def load_engine_config(engine_dir: str | Path) -> EngineConfig:
    engine_dir = Path(engine_dir)
    if not engine_dir.is_dir():
        raise UserError(f"engine directory {engine_dir} does not exist; build one with `build-engine`.")
    d = read_json(engine_dir / "config.json", "engine config")
    for key in ("pretrained_config", "build_config"):
        if not isinstance(d.get(key), dict):
            raise UserError(f"{engine_dir}/config.json has no '{key}' object; it is not an engine directory "
                            f"(a checkpoint? build it with `build-engine --checkpoint`).")
    info = parse_checkpoint_config(d["pretrained_config"], where=f"{engine_dir}/config.json pretrained_config")
    bc = d["build_config"]
    names = {f.name for f in dataclasses.fields(BuildConfig)}
    build = BuildConfig.from_dict({k: v for k, v in bc.items() if k in names}, where="build_config")
    backend = bc.get("backend", "trtllm")
    if backend not in BACKENDS:
        raise UserError(f"{engine_dir}/config.json build_config.backend is {backend!r}; expected one of {BACKENDS}.")
    spec = bc.get("speculation") or {}
    if not isinstance(spec, dict):
        raise UserError(f"{engine_dir}/config.json build_config.speculation must be an object, got {spec!r}.")
    where = f"{engine_dir}/config.json build_config.speculation"
    tree = info.redrafter or ReDrafterConfig.from_dict(
        {k: spec[k] for k in ("num_beams", "draft_len_per_beam") if k in spec}, where=where)
    names = {f.name for f in dataclasses.fields(ProposerConfig)}
    proposer = ProposerConfig.from_dict({k: v for k, v in spec.items() if k in names}, where=where)
    return EngineConfig(info, build, backend, str(d.get("version", "")), d, tree,
                        proposer.resolved(info.drafter is not None, tree.num_beams))
