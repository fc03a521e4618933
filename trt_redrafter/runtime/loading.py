"""What an engine settles once at load, per machine: which kernels its steps run (CUDA Triton kernels, the CPU's C++
kernels, or PyTorch's) and how they plug in, the drafter's dtype, where inductor keeps the kernels it compiles, and
the engine's proposers."""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path
from typing import Optional

import torch

from .. import cpu as cpu_kernels
from ..config import (PROPOSERS, BuildConfig, DrafterConfig, ModelConfig, ProposerConfig, ReDrafterConfig,
                      RuntimeConfig, torch_dtype)
from ..decoding import beam_search
from ..decoding.beam_search import SelectFn
from ..errors import UserError
from ..log import get_logger
from ..model.attention import cpu_tree_attention
from ..model.drafter import DrafterRank
from ..model.linear import linear_paths, resolve_linear
from ..model.llama import LlamaRank
from .distributed import Dist
from .drafter import DeviceDrafter
from .kv_cache import PagedKVCache
from .ngram import NGRAMS_FILE, ModelNgrams, NgramProposer
from .proposer import MixedProposer, Proposer, ReDrafterProposer
from .state import SlotState
from .step import StepKernels

logger = get_logger(__name__)

# TORCHINDUCTOR_CACHE_DIR at import, before an engine of this process points it at its own directory
USER_INDUCTOR_CACHE = os.environ.get("TORCHINDUCTOR_CACHE_DIR")


def resolve_kernels(want: str, device: torch.device, dtype: torch.dtype, head_size: int) -> str:
    """--kernels auto | triton | cpu | torch on this device -> "triton", "cpu" or "torch" (auto: the fastest that
    loads); one sentence where the asked-for kernels cannot run here."""
    if want == "torch":
        return "torch"
    if device.type != "cuda":
        if want == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
            raise UserError("--kernels triton needs a CUDA device (on the CPU the kernels run only under "
                            "TRITON_INTERPRET=1, in tests); use --kernels auto, cpu or torch.")
        if want != "triton":
            return _resolve_cpu_kernels(want, dtype, head_size)
    elif want == "cpu":
        raise UserError(f"--kernels cpu runs on the CPU, but this engine runs on {device}; use --kernels auto, "
                        f"triton or torch.")
    try:
        from .. import plugins  # noqa: F401
    except ImportError as e:
        if want == "triton":
            raise UserError(f"--kernels triton but the Triton kernels cannot load ({e}); pip install triton.") from e
        logger.warning("Triton kernels unavailable (%s); using the PyTorch path", e)
        return "torch"
    return "triton"


def _resolve_cpu_kernels(want: str, dtype: torch.dtype, head_size: int) -> str:
    """auto / cpu on the CPU -> "cpu" (trt_redrafter/cpu's tree attention) or "torch"."""
    why = None if cpu_kernels.available(dtype) else cpu_kernels.unavailable_reason(dtype)
    if why is None and not cpu_kernels.attention_supports(head_size):
        why = f"the model's head size {head_size} is not a multiple of 16 from 16 to 128"
    if why is not None:
        if want == "cpu":
            raise UserError(f"--kernels cpu: {why}; use --kernels auto or torch.")
        return "torch"
    try:
        cpu_kernels.ops()
    except UserError as e:
        if want == "cpu":
            raise
        logger.warning("%s; using the PyTorch attention", e)
        return "torch"
    return "cpu"


def default_drafter_dtype(device: torch.device, dtype: torch.dtype, linear: str) -> torch.dtype:
    """The drafter's dtype when none is asked for: bfloat16 for a float32 engine on a CPU whose kernels compute it
    natively (AVX512-BF16: half the bytes per drafted token; the drafter only proposes, so output is the same), else
    the model's."""
    if device.type == "cpu" and dtype == torch.float32 and linear == "avx512" and \
            cpu_kernels.available(torch.bfloat16):
        return torch.bfloat16
    return dtype


def default_drafter_weights(device: torch.device, linear: str) -> str:
    """`drafter_weights` auto, given the drafter's float layers' resolved `linear`: w8a8 where they run this project's
    AVX-512 kernels on a CPU with VNNI (its weights read in half the bytes of bf16, its products in bytes:
    docs/perf.md, "The drafter in bytes"), else as stored (CUDA, oneDNN's AMX tiles, --linear torch / onednn)."""
    if device.type == "cpu" and linear == "avx512" and cpu_kernels.vnni_available():
        return "w8a8"
    return ""


def load_drafter(cfg: Optional[DrafterConfig], tensors: dict[str, torch.Tensor], dist: Dist, runtime: RuntimeConfig,
                 build: BuildConfig, dtype: torch.dtype, linear: str) -> Optional[DrafterRank]:
    """This rank's drafter (None for an engine without one), in the asked-for dtype or `default_drafter_dtype`, its
    weights as asked or `default_drafter_weights`."""
    if cfg is None:
        return None
    d_dtype = torch_dtype(runtime.drafter_dtype) if runtime.drafter_dtype else \
        default_drafter_dtype(dist.device, dtype, linear)
    # auto resolves as float layers do; where it picks w8a8 they run avx512, which quantized layers resolve to as well
    explicit = runtime.drafter_weights != "auto"
    d_linear = resolve_linear(runtime.linear, dist.device, d_dtype,
                              quantized=explicit and bool(runtime.drafter_weights))
    weights = runtime.drafter_weights if explicit else default_drafter_weights(dist.device, d_linear)
    drafter = DrafterRank(cfg, tensors, dist, d_dtype, runtime.drafter_semantics or build.drafter_semantics, d_linear,
                          weights)
    if drafter.dtype != dtype or drafter.weights:
        logger.info("drafter in %s%s", drafter.dtype, f", {drafter.weights} weights" if drafter.weights else "")
    return drafter


def make_kv_cache(m: ModelConfig, build: BuildConfig, tokens: Optional[int], per_seq: int, num_slots: int,
                  dtype: torch.dtype, dist: Dist, reuse: bool = False) -> PagedKVCache:
    """The engine's paged KV cache: `tokens` positions (by default: max_batch_size requests of `per_seq` tokens, each
    rounded up to whole blocks), this rank's share of the KV heads; `reuse`: prefix reuse (kv_cache.py)."""
    bsz = build.kv_block_size
    tokens = tokens or build.max_tokens_in_paged_kv_cache or -(-per_seq // bsz) * bsz * build.max_batch_size
    return PagedKVCache(m.num_hidden_layers, -(-tokens // bsz), bsz, max(m.num_key_value_heads // dist.world_size, 1),
                        m.head_size, dtype, dist.device, max_slots=num_slots, max_blocks_per_seq=-(-per_seq // bsz),
                        reuse=reuse)


def prefix_reuse(asked: bool, tp: int, dynamic_rope: bool, record_hidden: bool) -> bool:
    """Whether the engine reuses cached prefixes: as asked, except where a reused block would not be what the request
    computes itself (dynamic-NTK RoPE rotates a prompt by its length), where its prompt step must see every token
    (`record_hidden`: the drafter trainer reads each one's hidden state), and under TP (every rank must reuse the
    same prefix, and the ranks' caches are not kept in step yet)."""
    if not asked:
        return False
    why = ("the model's RoPE is dynamic-NTK" if dynamic_rope else "every prompt token's hidden state is recorded"
           if record_hidden else f"TP {tp} (not supported yet)" if tp > 1 else None)
    if why:
        logger.info("KV prefix reuse off: %s", why)
    return why is None


def _users_inductor_cache() -> Optional[str]:
    """TORCHINDUCTOR_CACHE_DIR if the user set it. Inductor writes its default (/tmp/torchinductor_<user>) into the
    environment on first use (cache_dir_utils.cache_dir), so in a process that imported dynamo or inductor before
    this module it holds that default, which is not the user's choice (read as one, every engine's kernels went to
    /tmp instead of beside the engine).
    Called when compiling: importing torch._inductor at import would import triton too early for TRITON_INTERPRET."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    value = USER_INDUCTOR_CACHE
    if value is None or os.path.abspath(value) == os.path.abspath(default_cache_dir()):
        return None
    return value


def keep_inductor_cache(engine_dir: Optional[Path], rank: int, world_size: int) -> None:
    """Inductor's compiled kernels go beside the engine (`.cache/inductor`), so that the next process that loads it
    reuses them instead of compiling for minutes again; or where TORCHINDUCTOR_CACHE_DIR says; or, if the engine
    directory cannot be written, inductor's default under /tmp. Under TP each rank has its own subdirectory, as the
    ranks compile the same graphs at the same moment. Either way under a subdirectory per copy of the step kernels'
    sources (`kernel_sources_digest`): a compiled graph calls this project's ops by their schemas, which inductor's
    cache key does not hold (an argument left at its default is not in the traced graph), so kernels compiled
    against another version's ops must not be found (they fail at their first call)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from .costs import kernel_sources_digest

    user = _users_inductor_cache()
    where = [Path(user)] if user else []
    if not where and engine_dir is not None:
        where.append(engine_dir / ".cache" / "inductor")
    where.append(Path(default_cache_dir()))
    kernels = f"kernels-{kernel_sources_digest()}"
    for base in where:
        d = base / kernels / f"rank{rank}" if world_size > 1 else base / kernels
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(d, os.W_OK):
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(d)
            return


def plug_kernels(kernels: str, model: LlamaRank, cache: PagedKVCache, compile_mode: str
                 ) -> tuple[StepKernels, Optional[SelectFn]]:
    """Plug the chosen kernels into the model (tree attention, fused ops) -> the step's kernels and the device
    drafter's beam selection (None: torch.topk's)."""
    if kernels == "triton":
        from .. import plugins

        model.attention_impl = plugins.tree_attention
        model.ops = plugins.fused
        return StepKernels.triton([*cache.k, *cache.v], with_mover="inductor" not in compile_mode), plugins.beam_step
    if kernels == "cpu":
        model.attention_impl = cpu_tree_attention
        # the step rewinds every layer's cache in one call, eager or compiled (inductor calls the op in place: its
        # schema declares the caches mutated)
        return StepKernels(move_kv=cpu_kernels.kv_move), functools.partial(beam_search.select_beams_topk,
                                                                          topk=cpu_kernels.topk)
    return StepKernels(), None


def ngram_when(cfg: ProposerConfig, device: torch.device) -> str:
    """What an N-gram request proposes (ngram.py): `auto` = the model's drafts too on a GPU (a few more verified
    tokens cost almost nothing there), context matches only on a CPU."""
    if cfg.ngram_when == "auto":
        return "always" if device.type == "cuda" else "matched"
    return cfg.ngram_when


def make_proposers(cfg: ProposerConfig, tree: ReDrafterConfig, drafter: Optional[DeviceDrafter], when: str,
                   engine_dir: Optional[Path], vocab_size: int) -> dict[str, Proposer]:
    """The engine's proposers by name (config.PROPOSERS): a new proposer is registered here."""
    table = engine_dir / NGRAMS_FILE if engine_dir is not None else None
    ngram = NgramProposer(tree.num_beams, tree.draft_len_per_beam, cfg,
                          ModelNgrams.load(table, vocab_size) if table and table.is_file() else None, when=when)
    proposers: dict[str, Proposer] = {"redrafter": ReDrafterProposer(drafter), "ngram": ngram,
                                      "mixed": MixedProposer(drafter, ngram, cfg.ngram_beams, cfg.mixed_min_match)}
    assert set(proposers) == set(PROPOSERS)
    return proposers


def load_models(cfg, tensors: dict[str, torch.Tensor], dist: Dist, runtime: RuntimeConfig, dtype: torch.dtype,
                linear: str, record_hidden: bool) -> tuple[LlamaRank, Optional[DrafterRank], PagedKVCache, SlotState]:
    """An engine's base-model rank, its drafter's (None without one), the paged KV cache and the slot state
    (`cfg`: the engine's EngineConfig; `record_hidden`: the slot state keeps each request's last hidden state)."""
    info, build, tree = cfg.checkpoint, cfg.build, cfg.tree
    per_seq = build.max_seq_len + tree.max_tree_tokens  # a full request plus one draft tree
    t0 = time.perf_counter()
    model = LlamaRank(info.model, tensors, dist, dtype, per_seq, linear, info.quant)
    drafter = load_drafter(info.drafter, tensors, dist, runtime, build, dtype, linear)
    logger.info("model loaded in %.1fs (%s, linear layers: %s)", time.perf_counter() - t0, dtype,
                ", ".join(f"{n} {path}" for path, n in linear_paths(model, drafter).items()))
    num_slots = build.max_batch_size + 1  # + the padding slot
    reuse = prefix_reuse(runtime.kv_cache_reuse, dist.world_size, model.rope.dynamic, record_hidden)
    cache = make_kv_cache(info.model, build, runtime.kv_cache_tokens, per_seq, num_slots, dtype, dist, reuse)
    state = SlotState.allocate(num_slots, tree.num_beams, tree.draft_len_per_beam, dist.device)
    if record_hidden:
        state.record_hidden(info.model.hidden_size, dtype)
    return model, drafter, cache, state
