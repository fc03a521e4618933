"""Build a torch-backend engine directory from a TensorRT-LLM ReDrafter checkpoint.

The engine holds the checkpoint's rank files cast to the compute dtype (so loading is one mmap-backed read per
rank, no conversion) and a TensorRT-LLM-shaped `config.json` with the build limits.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from ..checkpoint.trtllm_config import parse_checkpoint_config
from ..config import BuildConfig, torch_dtype
from ..errors import UserError
from ..fsutil import atomic_output_dir, read_json, write_json
from ..log import get_logger
from ..runtime.engine_config import engine_config_dict

logger = get_logger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja")


def check_checkpoint(ckpt_dir: Path, tp: int | None):
    """Read and check a checkpoint dir; returns its CheckpointInfo."""
    if not ckpt_dir.is_dir():
        raise UserError(f"checkpoint directory {ckpt_dir} does not exist; create it with `trt-redrafter convert`.")
    info = parse_checkpoint_config(read_json(ckpt_dir / "config.json", "checkpoint config"),
                                   where=f"{ckpt_dir}/config.json")
    if tp is not None and tp != info.tp_size:
        raise UserError(f"--tp {tp} does not match the checkpoint {ckpt_dir}, which is sharded for tp={info.tp_size}; "
                        f"pass --tp {info.tp_size} or re-run convert with --tp {tp}.")
    missing = [f"rank{r}.safetensors" for r in range(info.tp_size) if not (ckpt_dir / f"rank{r}.safetensors").is_file()]
    if missing:
        raise UserError(f"checkpoint {ckpt_dir} lacks {', '.join(missing)}; re-run convert.")
    return info


def copy_tokenizer(src: Path, dst: Path) -> bool:
    files = [f for f in TOKENIZER_FILES if (src / f).is_file()]
    if not files:
        return False
    dst.mkdir(parents=True, exist_ok=True)
    for f in files:
        shutil.copy2(src / f, dst / f)
    return True


def build_torch_engine(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, build: BuildConfig,
                       tp: int | None = None, tokenizer_dir: str | os.PathLike | None = None,
                       force: bool = False) -> Path:
    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    info = check_checkpoint(ckpt_dir, tp)
    if not build.dtype:
        build = build.replace(dtype=info.model.dtype)
    dtype = torch_dtype(build.dtype)
    if build.max_seq_len > info.model.max_position_embeddings and not info.model.rotary_scaling:
        logger.warning("max_seq_len=%d exceeds the model's max_position_embeddings=%d without RoPE scaling",
                       build.max_seq_len, info.model.max_position_embeddings)
    with atomic_output_dir(out_dir, force, what="engine") as tmp:
        for r in range(info.tp_size):
            src = ckpt_dir / f"rank{r}.safetensors"
            tensors = load_file(str(src))
            if all(t.dtype == dtype for t in tensors.values()):
                shutil.copy2(src, tmp / src.name)
            else:
                save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()}, str(tmp / src.name))
            del tensors
        write_json(tmp / "config.json", engine_config_dict(info, build, "torch"))
        if tokenizer_dir is not None:
            if not copy_tokenizer(Path(tokenizer_dir), tmp / "tokenizer"):
                raise UserError(f"--tokenizer {tokenizer_dir} holds no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}).")
    logger.info("built torch engine %s (tp=%d, %s, max_batch_size=%d, max_seq_len=%d)", out_dir, info.tp_size,
                build.dtype, build.max_batch_size, build.max_seq_len)
    return out_dir
