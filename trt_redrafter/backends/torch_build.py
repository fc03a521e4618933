"""Build a torch-backend engine directory from a TensorRT-LLM ReDrafter checkpoint, or a plain LLaMA one.

The engine holds the checkpoint's rank files cast to the compute dtype (so loading is one mmap-backed read per
rank, no conversion), a TensorRT-LLM-shaped `config.json` with the build limits and the speculation settings, and
(unless turned off) `ngrams.safetensors`: the base's bigram drafts for the N-gram proposer (runtime/ngram.py).
A plain LLaMA checkpoint (no drafter) builds an engine that speculates with the N-gram proposer only.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from ..checkpoint.quantization import require_torch_runs
from ..checkpoint.tokenizer_files import make_portable
from ..checkpoint.trtllm_config import parse_checkpoint_config
from ..config import BuildConfig, ProposerConfig, ReDrafterConfig, torch_dtype
from ..errors import UserError
from ..fsutil import atomic_output_dir, read_json, write_json
from ..log import get_logger
from ..checkpoint.engine_config import engine_config_dict

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
    make_portable(dst)  # a tokenizer saved by transformers 5 loads in a TensorRT-LLM container's 4.5x too
    return True


def build_torch_engine(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, build: BuildConfig,
                       tp: int | None = None, tokenizer_dir: str | os.PathLike | None = None,
                       force: bool = False, tree: ReDrafterConfig | None = None,
                       proposer: ProposerConfig | None = None) -> Path:
    """`tree` (nb, dl) is the draft-tree shape of an engine whose checkpoint has no drafter (default: ReDrafterConfig.project(), 4 x 4); a
    ReDrafter checkpoint fixes its own. `proposer` holds the proposer settings (config.ProposerConfig)."""
    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    info = check_checkpoint(ckpt_dir, tp)
    require_torch_runs(info.quant, f"{ckpt_dir}/config.json")
    proposer = proposer or ProposerConfig()
    if info.redrafter is None:
        tree = tree or ReDrafterConfig.project()
        logger.info("%s has no drafter: the engine drafts with N-grams (%d beams x %d tokens)", ckpt_dir,
                    tree.num_beams, tree.draft_len_per_beam)
    elif tree is not None and (tree.num_beams, tree.draft_len_per_beam) != (info.redrafter.num_beams,
                                                                            info.redrafter.draft_len_per_beam):
        raise UserError(f"checkpoint {ckpt_dir} was converted for {info.redrafter.num_beams} beams x "
                        f"{info.redrafter.draft_len_per_beam} tokens; its tree shape is fixed (re-run convert with "
                        f"--num-beams/--draft-len-per-beam to change it).")
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
            # weights take the engine's dtype; integer tensors (a draft vocabulary's token ids, int4 weights), FP8
            # weights and the quantization scales of a W4A16_AWQ or FP8 base stay as they are
            def keep(name: str, t) -> bool:
                return not t.is_floating_point() or t.dtype == dtype or t.element_size() == 1 or \
                    name.endswith(("weights_scaling_factor", "activation_scaling_factor"))

            if all(keep(k, t) for k, t in tensors.items()):
                shutil.copy2(src, tmp / src.name)
            else:
                save_file({k: v if keep(k, v) else v.to(dtype).contiguous() for k, v in tensors.items()},
                          str(tmp / src.name))
            del tensors
        write_json(tmp / "config.json", engine_config_dict(info, build, "torch", tree, proposer))
        if proposer.model_ngrams != "off":
            write_model_ngrams(tmp, info, force=proposer.model_ngrams == "on")
        if tokenizer_dir is not None:
            if not copy_tokenizer(Path(tokenizer_dir), tmp / "tokenizer"):
                raise UserError(f"--tokenizer {tokenizer_dir} holds no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}).")
    logger.info("built torch engine %s (tp=%d, %s, max_batch_size=%d, max_seq_len=%d)", out_dir, info.tp_size,
                build.dtype, build.max_batch_size, build.max_seq_len)
    return out_dir


CPU_TABLE_FLOPS = 40e12  # `--model-ngrams auto` builds on a CPU only up to minutes of work (SmolLM2-135M: 13 TFLOP)


def write_model_ngrams(engine_dir: Path, info, force: bool = False) -> None:
    """The base's bigram table (runtime/ngram.py) from the engine's own rank files, on CUDA when one is visible;
    on a CPU only when it takes minutes, unless `force`."""
    import torch

    from ..checkpoint import sharding
    from ..checkpoint.quantization import dequantize_stored
    from ..model.llama import LlamaRank
    from ..model.tp import Dist
    from ..runtime.ngram import NGRAMS_FILE, build_model_ngrams

    m = info.model
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    params = m.num_hidden_layers * (4 * m.hidden_size ** 2 + 3 * m.hidden_size * m.intermediate_size) + \
        m.vocab_size * m.hidden_size
    flops = 2 * params * m.vocab_size
    if device.type == "cpu" and flops > CPU_TABLE_FLOPS and not force:
        logger.warning("skipping the model N-gram table: %.0f TFLOP is hours on this CPU (N-gram drafts will come "
                       "from the context alone); build on a GPU machine, or pass --model-ngrams on", flops / 1e12)
        return
    ranks = [load_file(str(engine_dir / f"rank{r}.safetensors")) for r in range(info.tp_size)]
    quant = info.quant
    if info.tp_size == 1:
        tensors = ranks[0]
    else:  # one rank holding everything: unshard by TensorRT-LLM's rules, then shard for tp=1
        if quant is not None and quant.stored_quantized:  # the table needs the base's values, not its arithmetic
            ranks = [dequantize_stored(r, quant, torch.float32, f"{engine_dir}/rank{i}.safetensors")
                     for i, r in enumerate(ranks)]
            quant = None
        full = sharding.unshard_base(ranks, m)
        tensors = sharding.shard_base(full.__getitem__, m, sharding.Mapping(1, 0), lambda t: t)
    del ranks
    dtype = tensors["transformer.vocab_embedding.weight"].dtype
    if device.type == "cpu" and dtype != torch.float32:
        dtype = torch.float32  # CPU matmuls in half precision are slow and not what the CPU runtime computes in
    model = LlamaRank(m, tensors, Dist(0, 1, device), dtype, max_seq_len=1, quant=quant)
    del tensors
    build_model_ngrams(model, m.vocab_size).save(engine_dir / NGRAMS_FILE)
