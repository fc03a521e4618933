"""This project's CPU kernels (C++ with AVX-512), built at first use by `torch.utils.cpp_extension` and registered
as the torch ops `trt_redrafter_cpu::*`, which eager code calls directly and `torch.compile` calls as external
kernels (their fake functions below give it the output shapes).

    pack, linear     y = x W^T (+ b) over W packed in 16-column panels      linear.cpp   oracle: F.linear
    linear_wo        the same over weight-only int8 / int4 W = q s           linear.cpp   oracle: F.linear of q s
                     (q and s packed by `pack_wo` below; bf16 inputs on
                     AVX512-BF16: VDPBF16PS over k pairs, `wo_pairs`)
    linear_w8a8      the same over int8 (or int4) W = q s with the input     linear.cpp   oracle: `w8a8_reference`
                     quantized to int8 per row (VNNI; the drafter: `pack_w8a8`)
    tree_attention   tree attention reading the paged KV cache in place      attention.cpp
                                                              oracle: model.attention.torch_tree_attention
    topk             each row's k largest values and their indices           topk.cpp     oracle: torch.topk
                     (the drafter's beam search: decoding.beam_search)
    kv_move          the KV rewind of every layer cache in one call          attention.cpp
                                                              oracle: runtime.step.move_kv
    beam_draft       the drafter's whole beam search: its layers (the        draft.cpp
                     kernels above), top-k and the beams' bookkeeping
                                               oracle: decoding.beam_search.beam_search (runtime/drafter.py)

The linear and attention kernels compute every output element in one fixed order that does not depend on how many
rows (tokens) a step has, which greedy ReDrafter == greedy AR needs. The build needs a C++ compiler (the one inductor
uses) and ninja; it takes ~30 s once per torch version and is kept under TORCH_EXTENSIONS_DIR (default
~/.cache/torch_extensions).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import sys
import sysconfig
from typing import Optional

import torch

from ..errors import UserError
from ..log import get_logger

logger = get_logger(__name__)

_SOURCES = [os.path.join(os.path.dirname(__file__), name) for name in ("linear.cpp", "attention.cpp", "topk.cpp",
                                                                              "draft.cpp")]
_BUILD_ERROR: list[str] = []  # the first build failure: a process tries once
_CFLAGS = ["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"]


# the instruction sets a run's figures depend on (bench-engine records which of them the machine has)
FEATURES = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")


def cpuinfo(key: str) -> str:
    """The first /proc/cpuinfo value of `key`, '' where there is none (or no /proc)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.split(":", 1)[0].strip() == key), "")
    except OSError:
        return ""


def model_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what `platform` knows."""
    return cpuinfo("model name") or platform.processor() or platform.machine()


def features() -> list[str]:
    """Which of FEATURES this CPU has (its /proc/cpuinfo flags)."""
    flags = set(cpuinfo("flags").split())
    return [f for f in FEATURES if f in flags]


def available(dtype: torch.dtype) -> bool:
    """Whether this CPU runs the kernels in `dtype`: AVX-512 for float32, AVX512-BF16 for bfloat16."""
    if dtype == torch.float32:
        return torch.backends.cpu.get_cpu_capability() in ("AVX512", "AMX")  # AMX CPUs have AVX-512 too
    if dtype == torch.bfloat16:
        return bool(torch.cpu._is_avx512_bf16_supported())
    return False


def unavailable_reason(dtype: torch.dtype) -> str:
    """Why `available(dtype)` is false, for the refusals of an explicit --linear avx512 / --kernels cpu."""
    return f"this CPU has no AVX-512 for {dtype} (float32 needs AVX-512F, bfloat16 AVX512-BF16)"


def attention_supports(head_size: int) -> bool:
    """Head sizes attention.cpp is compiled for (its q and accumulator live in registers)."""
    return head_size % 16 == 0 and 16 <= head_size <= 128


def ops():
    """Build (first use) and load the kernels -> `torch.ops.trt_redrafter_cpu`. Raises UserError when they cannot
    be built, naming what is missing."""
    if hasattr(torch.ops.trt_redrafter_cpu, "linear"):
        return torch.ops.trt_redrafter_cpu
    if _BUILD_ERROR:
        raise UserError(_BUILD_ERROR[0])
    from torch.utils import cpp_extension
    build_dir = _build_dir()
    if not os.path.exists(os.path.join(build_dir, "trt_redrafter_cpu.so")):
        logger.info("building the AVX-512 CPU kernels (trt_redrafter/cpu) in %s: once, ~30 s", build_dir)
    try:
        with _quiet("torch.utils.cpp_extension"), _exclusive(build_dir), _declared_ninja():
            cpp_extension.load(name="trt_redrafter_cpu", sources=_SOURCES, is_python_module=False,
                               extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"], build_directory=build_dir,
                               verbose=False)
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a compile error: each means "cannot build"
        lines = str(e).strip().splitlines() or [""]
        last = next((ln.strip() for ln in lines if "error:" in ln), lines[-1])  # a compiler's first error
        _BUILD_ERROR.append(f"the AVX-512 CPU kernels did not build ({type(e).__name__}: {last}); they need a C++ "
                            f"compiler (apt-get install g++) and ninja (pip install ninja); or use --linear onednn "
                            f"--kernels torch")
        raise UserError(_BUILD_ERROR[0]) from e
    torch.library.register_fake("trt_redrafter_cpu::linear", _linear_fake)
    torch.library.register_fake("trt_redrafter_cpu::linear_wo", _linear_wo_fake)
    torch.library.register_fake("trt_redrafter_cpu::linear_w8a8", _linear_w8a8_fake)
    torch.library.register_fake("trt_redrafter_cpu::tree_attention", _tree_attention_fake)
    torch.library.register_fake("trt_redrafter_cpu::topk", _topk_fake)
    torch.library.register_fake("trt_redrafter_cpu::beam_draft", _beam_draft_fake)
    return torch.ops.trt_redrafter_cpu


def _build_dir() -> str:
    """One build per torch version and Python (a build links against one libtorch) and per copy of the sources,
    under torch's extensions directory (TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                    "torch_extensions")
    tag = f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__.replace('+', '_')}"
    # and per installed copy of these sources: two checkouts (or a wheel and a checkout) sharing one build would
    # rebuild it in turn, since ninja's commands name the source paths
    where = hashlib.sha1(os.path.dirname(os.path.abspath(__file__)).encode()).hexdigest()[:8]
    path = os.path.join(root, f"trt_redrafter_cpu-{tag}-{where}")
    os.makedirs(path, exist_ok=True)
    return path


@contextlib.contextmanager
def _exclusive(build_dir: str):
    """One process at a time builds or loads (TP ranks start together). torch's own build lock is a file that a
    process killed mid-build leaves behind, after which every later load waits for it forever; the kernel releases
    this flock when its holder dies, and whoever holds it may clear such a stale file."""
    with open(os.path.join(build_dir, "trt_redrafter.flock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            stale = os.path.join(build_dir, "lock")  # torch.utils.file_baton.FileBaton's file
            if os.path.exists(stale):
                logger.warning("removing %s, left by a build that did not finish", stale)
                os.remove(stale)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def _declared_ninja():
    """torch runs `ninja` from PATH, and ninja versions hash a build's commands differently (1.13 and 1.11 do): where a
    machine has two (the `ninja` package this project declares, and a system one), processes with different PATHs
    (a server's rank 0 in Triton's stub, its follower ranks under mpirun, a user's shell) each found the other's
    objects stale and built the kernels again, ~20 s each time, and a rank killed mid-build left the lock file
    `_exclusive` clears. So every load runs the declared package's ninja, the same binary in every process."""
    bin_dir = _declared_ninja_dir()
    if bin_dir is None:  # no package binary: PATH's ninja, as torch would
        yield
        return
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = bin_dir + os.pathsep + path
    try:
        yield
    finally:
        os.environ["PATH"] = path


def _declared_ninja_dir() -> Optional[str]:
    """The directory of the `ninja` package's binary: its BIN_DIR (this environment's scripts), else, in a virtualenv
    that sees its base's packages (ci/transformers4.sh's), the base's scripts, where that package put it."""
    try:
        import ninja

        dirs = [ninja.BIN_DIR]
    except (ImportError, AttributeError):
        return None
    dirs.append(sysconfig.get_path("scripts", vars={"base": sys.base_prefix, "platbase": sys.base_prefix}))
    return next((d for d in dirs if d and os.access(os.path.join(d, "ninja"), os.X_OK)), None)


@contextlib.contextmanager
def _quiet(name: str):
    log = logging.getLogger(name)
    level = log.level
    log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        log.setLevel(level)


def _topk_fake(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (*x.shape[:-1], k)
    return x.new_empty(shape), x.new_empty(shape, dtype=torch.long)


def _beam_draft_fake(h, true_token, embedding, weights, bits, out_features, has_proj: bool, bf16: bool, num_beams,
                     max_beams: int, draft_len: int, warp_top_k: int, vocab: int, ids, depth_rows):
    bs = h.shape[0]
    return (true_token.new_empty(bs, num_beams, draft_len + 1),
            h.new_empty(bs, num_beams, draft_len, dtype=torch.float32))


def kv_move(caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """cache[dst] = cache[src] in every cache (src, dst [bs, bl] rows; every source read before any destination is
    written): `runtime.step.move_kv`'s contract in one call (attention.cpp)."""
    torch.ops.trt_redrafter_cpu.kv_move(caches, src.reshape(-1), dst.reshape(-1))


def topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of each row along the last dimension of a float32 CPU tensor, descending, equal values in
    ascending index order (topk.cpp) -> (values, int64 indices); `torch.topk`'s contract for the beam search."""
    return torch.ops.trt_redrafter_cpu.topk(x, k)


def _linear_fake(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


def _linear_wo_fake(x, qweight, scales, bits: int, group_size: int, out_features: int, bias) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


def _linear_w8a8_fake(x, packed, colsum, scales, out_features: int, bias, bits: int = 8) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


def vnni_available() -> bool:
    """Whether this CPU has AVX512-VNNI (`linear_w8a8`'s byte dot products) and the kernels build."""
    try:
        return bool(available(torch.float32) and ops().has_vnni())
    except UserError:
        return False


def wo_pairs(dtype: torch.dtype, group_size: int) -> bool:
    """Whether `linear_wo` runs a layer of this input dtype and group size over k pairs with VDPBF16PS (bf16 inputs,
    an AVX512-BF16 CPU, an even group size) rather than widening to fp32 FMAs: the same test as linear.cpp's."""
    return dtype == torch.bfloat16 and group_size % 2 == 0 and bool(ops().has_bf16())


DEFAULT_PREFETCH_BYTES = 1024


def prefetch_bytes() -> int:
    """How far ahead the linear kernels prefetch each panel stream of weights, in bytes (0: no prefetch):
    TRT_REDRAFTER_PREFETCH as the kernels read it when they loaded, else DEFAULT_PREFETCH_BYTES, or what
    `set_prefetch_bytes` set since (cpu/linear.cpp)."""
    return int(ops().prefetch_bytes())


def set_prefetch_bytes(n: int) -> int:
    """Set the linear kernels' weight prefetch distance in bytes (0: none) for this process -> the previous one."""
    return int(ops().set_prefetch_bytes(int(n)))


def loaded_prefetch_bytes() -> Optional[int]:
    """`prefetch_bytes()` where this process has loaded the kernels, else None (nothing is built or loaded here)."""
    return int(torch.ops.trt_redrafter_cpu.prefetch_bytes()) if hasattr(torch.ops.trt_redrafter_cpu,
                                                                         "prefetch_bytes") else None


def pack_w8a8(q: torch.Tensor, scales: torch.Tensor, bits: int = 8
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int8 q [out, in] (bits 4: values in [-8, 7]) and its per-channel scales [out] or [out, 1] -> (packed panels,
    column sums, scales padded to whole panels, fp32): `linear_w8a8`'s weight arguments (and its `bits`)."""
    packed, colsum = ops().pack_w8a8(q.contiguous(), bits)
    padded = torch.zeros(colsum.numel(), dtype=torch.float32)
    padded[:q.shape[0]] = scales.reshape(-1).float()
    return packed, colsum, padded


def w8a8_reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                   bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`linear_w8a8`'s oracle: each row of x [M, in] quantized to int8 (symmetric, sx = max|x| / 127, round half to
    even), the exact integer product with q [out, in], times sx * scales [out] in fp32, + bias, in x's dtype."""
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True)
    sx = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    xq = torch.round(xf * (1 / sx))
    acc = (xq.double() @ q.double().t()).float()  # the exact integer sum, rounded to fp32 as the kernel converts it
    y = acc * (scales.reshape(1, -1).float() * sx)
    return (y if bias is None else y + bias.float()).to(x.dtype)


PANEL = 16  # output columns per panel (linear.cpp kCols)


def pack_wo(q: torch.Tensor, scales: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight-only q [N, K] (int8 values; for bits=4 in [-8, 7]) and scales [N, G] -> (bytes, fp32 scales) in the
    panel layouts `linear_wo` reads: int8 [P, K, 16], int4 [P, K / 2, 16] (k = 2j in the low nibble, 2j + 1 in the
    high one), scales [P, G, 16]; P = ceil(N / 16), padded with zeros."""
    N, K = q.shape
    assert bits in (4, 8) and scales.shape[0] == N and (bits == 8 or K % 2 == 0), (bits, tuple(q.shape))
    P = -(-N // PANEL)
    qp = torch.zeros(P * PANEL, K, dtype=torch.int8)
    qp[:N] = q
    u = qp.view(torch.uint8)
    if bits == 4:
        u = (u[:, 0::2] & 0xF) | ((u[:, 1::2] & 0xF) << 4)
    sp = torch.zeros(P * PANEL, scales.shape[1], dtype=torch.float32)
    sp[:N] = scales.float()
    return (u.reshape(P, PANEL, -1).transpose(1, 2).contiguous(),
            sp.view(P, PANEL, -1).transpose(1, 2).contiguous())


def _tree_attention_fake(q, k_cache, v_cache, block_table, ctx_len, tree_mask, block_size: int, scale: float):
    return torch.empty_like(q)
