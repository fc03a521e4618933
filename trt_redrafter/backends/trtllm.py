"""The `trtllm` backend: build and run ReDrafter engines with the real TensorRT-LLM (TensorRT-engine path).

Pinned to TensorRT-LLM 1.0-1.2.x, the releases that still have `trtllm-build`, the C++ Executor and
`ReDrafterForLLaMALM`. `tensorrt_llm` is imported inside functions only, so this module imports everywhere.

What each function does is what the TensorRT-LLM command line does, through its Python API; the source files
followed are cited where they are used (paths inside the NVIDIA/TensorRT-LLM repository). See docs/tensorrt-llm.md
for the API surface, what was verified and what was not.

Engine directory written by `build_trtllm_engine` (OUT):
    config.json            TensorRT-LLM's own (`Engine.save`), left byte-for-byte as TensorRT-LLM wrote it
    rank{r}.engine         one serialized TensorRT engine per TP rank
    trt_redrafter.json     this project's marker: {"backend": "trtllm", the equivalent trtllm-build argv, versions}
    tokenizer/             when a tokenizer dir was given
The backend marker is NOT put into config.json's build_config: TensorRT-LLM's runtime re-reads that object
(`ModelRunnerCpp.from_dir` -> `EngineConfig.from_json_file` -> `BuildConfig.from_dict`), and from TensorRT-LLM's
move of BuildConfig to pydantic (PR #8330, late 2025) we could not verify that an unknown key is still ignored.
`checkpoint/engine_config.load_engine_config` already reads an engine without `build_config.backend` as `trtllm`.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ..config import BuildConfig, SamplingConfig
from ..errors import UserError
from ..fsutil import atomic_output_dir, write_json
from ..log import get_logger, rank0_print

logger = get_logger(__name__)

TRTLLM_SUPPORTED = ">=1.0,<1.3"
MARKER_FILE = "trt_redrafter.json"
# Head sizes TensorRT-LLM's attention plugin builds (masked multi-head attention kernels); any other aborts the
# build inside TensorRT ("Head size N is not supported by MMHA"). HEAD_SIZES_SOURCE says where it was read.
MMHA_HEAD_SIZES = (32, 48, 64, 80, 96, 104, 112, 128, 144, 160, 192, 224, 256)
HEAD_SIZES_SOURCE = "cpp/tensorrt_llm/kernels/decoderMaskedMultiheadAttention"

# pip's prerequisites are TensorRT-LLM's own (docs/source/installation/linux.md @ 004da3c2): the Open MPI development
# package, a CUDA toolkit with CUDA_HOME set, and torch from the PyTorch index of the release's CUDA
_INSTALL_HINT = ("run inside NVIDIA's NGC container nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3 (one whose "
                 "TensorRT-LLM is 1.0-1.2), or install TensorRT-LLM's prerequisites (`apt-get install libopenmpi-dev`, "
                 "the CUDA toolkit with CUDA_HOME set, torch from https://download.pytorch.org/whl/cu<XY> for the "
                 "release's CUDA) then `pip install tensorrt_llm==1.2.* --extra-index-url https://pypi.nvidia.com` "
                 "(docs/tensorrt-llm.md), on a machine with an NVIDIA GPU of compute capability 8.0 or newer")


# ---------------------------------------------------------------------------------------------------------------
# Import and version pin
# ---------------------------------------------------------------------------------------------------------------
def version_supported(version: str) -> bool:
    """True when `version` is inside TRTLLM_SUPPORTED (release candidates of 1.1/1.2 included, of 1.3 not)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        return SpecifierSet(TRTLLM_SUPPORTED, prereleases=True).contains(Version(version))
    except InvalidVersion:
        return False


def require_trtllm():
    """Import `tensorrt_llm` and check it against the pin; returns the module or raises one clear UserError."""
    try:
        # tensorrt_llm/__init__.py prints "[TensorRT-LLM] TensorRT LLM version: ..." on stdout at import time;
        # keep stdout clean for `run --json`.
        with contextlib.redirect_stdout(sys.stderr):
            import tensorrt_llm
    except ModuleNotFoundError as e:
        if e.name != "tensorrt_llm":
            raise UserError(f"tensorrt_llm is installed but cannot be imported (missing module {e.name!r}); "
                            f"{_INSTALL_HINT}.") from e
        raise UserError(f"the trtllm backend needs TensorRT-LLM {TRTLLM_SUPPORTED} and tensorrt_llm is not installed; "
                        f"{_INSTALL_HINT}, or use --backend torch.") from e
    except (ImportError, OSError, RuntimeError) as e:
        raise UserError(f"tensorrt_llm is installed but fails to import ({e}); {_INSTALL_HINT}.") from e
    version = str(getattr(tensorrt_llm, "__version__", ""))
    if not version_supported(version):
        raise UserError(f"tensorrt_llm {version or '(unknown version)'} is installed but the trtllm backend supports "
                        f"TensorRT-LLM {TRTLLM_SUPPORTED} (later releases dropped the TensorRT-engine path and "
                        f"ReDrafter); {_INSTALL_HINT}.")
    return tensorrt_llm


# ---------------------------------------------------------------------------------------------------------------
# Build
# ---------------------------------------------------------------------------------------------------------------
def trtllm_build_argv(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, build: BuildConfig,
                      info) -> list[str]:
    """The `trtllm-build` arguments equivalent to a build with `build` of the checkpoint described by `info`.

    build_trtllm_engine parses exactly these with trtllm-build's own parser, so the defaults of every option we do
    not name are the installed release's. Flag names: tensorrt_llm/commands/build.py (`parse_arguments`) and
    tensorrt_llm/plugin/plugin.py (`add_plugin_argument`).
    """
    dtype = info.model.dtype
    spec = ["--speculative_decoding_mode", "explicit_draft_tokens"] if info.redrafter is not None else []
    return [
        "--checkpoint_dir", str(ckpt_dir),
        "--output_dir", str(out_dir),
        "--gemm_plugin", dtype,
        *spec,
        "--max_beam_width", "1",
        "--max_batch_size", str(build.max_batch_size),
        "--max_input_len", str(build.max_input_len),
        "--max_seq_len", str(build.max_seq_len),
        "--max_num_tokens", str(build.resolved_max_num_tokens(info.redrafter)),
        "--kv_cache_type", "paged",
        "--remove_input_padding", "enable",
        "--context_fmha", "enable",
        "--use_paged_context_fmha", "enable",
    ]


def check_buildable(info, build: BuildConfig, ckpt_dir: Path) -> None:
    """What TensorRT-LLM 1.0-1.2 would refuse late (or with a raw traceback), refused before it is imported."""
    from ..checkpoint.trtllm_config import LEGACY_ARCH, redrafter_architecture

    where = f"{ckpt_dir}/config.json"
    if info.drafter is not None and info.drafter.replicated:
        raise UserError(f"{where}: every rank holds the whole drafter (convert replicates it where --tp {info.tp_size} "
                        f"does not divide its dimensions), which TensorRT-LLM cannot build (it splits the drafter); "
                        f"use --backend torch, or a TP size that divides the drafter's exit_dim and vocabulary.")
    if info.quant is not None and info.quant.bits and info.quant.quantizes("lm_head"):
        # its build quantizes only layer weights (convert_utils.weight_only_quantize_dict: names with qkv, dense, fc,
        # gate or proj), and ModelOpt quantizes lm_head for FP8 alone: a float lm_head under a weight-only layer
        raise UserError(f"{where}: the base's lm_head is quantized ({info.quant.algo}, --quantize-lm-head), which "
                        f"TensorRT-LLM's weight-only build does not do; use --backend torch, or re-convert without "
                        f"--quantize-lm-head.")
    # a plain LLaMA checkpoint (no drafter) builds TensorRT-LLM's auto-regressive engine: the AR baseline
    if info.redrafter is not None and info.architecture == LEGACY_ARCH:
        # PretrainedConfig.from_dict indexes MODEL_MAP[config['architecture']] first: a bare KeyError otherwise
        raise UserError(f"{where} has architecture {info.architecture!r}, the legacy format of TensorRT-LLM <= 0.21, "
                        f"which TensorRT-LLM {TRTLLM_SUPPORTED} cannot load; re-convert with --trtllm-format 1.x "
                        f"(architecture {redrafter_architecture(info.model.architecture, '1.x')}).")
    if info.redrafter is not None and info.model.qk_layernorm:
        # examples/redrafter/convert_checkpoint.py @31a9cd42: REDRAFTER_MAP = {QWenForCausalLM, Qwen2ForCausalLM:
        # ReDrafterForQWenLM, LlamaForCausalLM: ReDrafterForLLaMALM}; a Qwen3 base is a KeyError there
        raise UserError(f"{where}: a Qwen3 base, which TensorRT-LLM's own ReDrafter converter does not take "
                        f"(REDRAFTER_MAP in examples/redrafter/convert_checkpoint.py has Qwen and Qwen2 only), so no "
                        f"TensorRT-LLM ReDrafter engine of it is known to work; use --backend torch.")
    head = info.model.head_size
    if head not in MMHA_HEAD_SIZES:
        raise UserError(f"{where} has head size {head} (hidden {info.model.hidden_size} / "
                        f"{info.model.num_attention_heads} heads), which TensorRT-LLM's attention plugin does not "
                        f"support (head sizes {', '.join(map(str, MMHA_HEAD_SIZES))}); use --backend torch for "
                        f"this model.")
    if info.drafter is not None and info.drafter.draft_vocab_size:
        raise UserError(f"{where}: the drafter scores a draft vocabulary of {info.drafter.draft_vocab_size} tokens "
                        f"(train-drafter --draft-vocab), which TensorRT-LLM's ReDrafter cannot run; use --backend "
                        f"torch, or a drafter trained with --draft-vocab 0 for TensorRT-LLM.")
    if info.redrafter is not None and build.drafter_semantics != "apple":
        raise UserError(f"--drafter-semantics {build.drafter_semantics} is the drafter math of TensorRT-LLM <= 0.13; "
                        f"TensorRT-LLM {TRTLLM_SUPPORTED} builds only Apple's (--drafter-semantics apple, the "
                        f"default); use --backend torch to run the old math.")


def check_release_accepts(info, version: str, ckpt_dir: Path) -> None:
    """The installed release's Mapping/QuantConfig take every key the checkpoint holds (else a bare TypeError)."""
    from ..checkpoint.trtllm_config import unaccepted_keys

    line = ".".join(version.split(".")[:2])
    bad = unaccepted_keys(info.raw, line)
    if bad:
        raise UserError(f"{ckpt_dir}/config.json holds {', '.join(bad)}, which TensorRT-LLM {version}'s "
                        f"Mapping/QuantConfig do not accept; re-convert it with `trt-redrafter convert` (it writes "
                        f"only keys that TensorRT-LLM {TRTLLM_SUPPORTED} all accept).")


def _trtllm_build_config(argv: list[str]):
    """(TensorRT-LLM BuildConfig, parsed args) for `argv`, as `tensorrt_llm/commands/build.py:main` makes them.

    main() does: parse_arguments().parse_args(); PluginConfig.from_arguments(args); plugin_config.validate();
    SpeculativeDecodingMode.from_arguments(args); BuildConfig.from_dict({...}, plugin_config=...) then
    update_from_dict({'kv_cache_type': ...}) (1.0) or BuildConfig(...) keywords (after PR #8330). The keyword
    constructor below works with both: in 1.0 BuildConfig is a dataclass with these fields (tensorrt_llm/builder.py).
    """
    from tensorrt_llm.builder import BuildConfig as TrtBuildConfig
    from tensorrt_llm.commands.build import parse_arguments
    from tensorrt_llm.models.modeling_utils import SpeculativeDecodingMode
    from tensorrt_llm.plugin import PluginConfig

    try:
        args = parse_arguments().parse_args(argv)
    except SystemExit as e:  # argparse already printed why
        raise UserError(f"the installed TensorRT-LLM rejected the trtllm-build arguments {' '.join(argv)}.") from e
    plugin_config = PluginConfig.from_arguments(args)
    plugin_config.validate()
    build_config = TrtBuildConfig(
        max_input_len=args.max_input_len,
        max_seq_len=args.max_seq_len,
        max_batch_size=args.max_batch_size,
        max_beam_width=args.max_beam_width,
        max_num_tokens=args.max_num_tokens,
        opt_num_tokens=args.opt_num_tokens,
        max_prompt_embedding_table_size=args.max_prompt_embedding_table_size,
        kv_cache_type=args.kv_cache_type,  # parsed by trtllm-build's own enum parser, so the release's type
        gather_context_logits=False,
        gather_generation_logits=False,
        strongly_typed=True,  # trtllm-build always passes True
        weight_sparsity=args.weight_sparsity,
        profiling_verbosity=args.profiling_verbosity,
        enable_debug_output=args.enable_debug_output,
        max_draft_len=args.max_draft_len,  # 0: tensorrt_llm/builder.py:build sets num_beams * draft_len_per_beam
        speculative_decoding_mode=SpeculativeDecodingMode.from_arguments(args),
        input_timing_cache=args.input_timing_cache,
        output_timing_cache=args.output_timing_cache,
        dry_run=args.dry_run,
        visualize_network=args.visualize_network,
        max_encoder_input_len=args.max_encoder_input_len,
        weight_streaming=args.weight_streaming,
        monitor_memory=args.monitor_memory,
        plugin_config=plugin_config,
    )
    return build_config, args


def _build_rank(rank: int, gpu_id: int, argv: list[str], log_level: str = "info") -> int:
    """Build and save the engine of one TP rank (a top-level function so a spawned process pool can run it).

    Follows tensorrt_llm/commands/build.py `build_and_save` + `build_model`: set the GPU, load the checkpoint
    config (`PretrainedConfig.from_json_file`), copy it and `set_rank(rank)`, `MODEL_MAP[architecture]
    .from_checkpoint(ckpt_dir, config=rank_config)` (reads rank{r}.safetensors), `tensorrt_llm.builder.build`,
    `Engine.save(output_dir)` (rank 0 also writes config.json).
    """
    import torch

    tensorrt_llm = require_trtllm()
    from tensorrt_llm.logger import logger as trt_logger
    from tensorrt_llm.models import MODEL_MAP, PretrainedConfig

    torch.cuda.set_device(gpu_id)
    trt_logger.set_level(log_level)
    build_config, args = _trtllm_build_config(argv)
    # an architecture TensorRT-LLM has no class for (the legacy format) was refused by check_buildable before this
    # process started: PretrainedConfig.from_json_file itself indexes MODEL_MAP and would raise a bare KeyError
    model_config = PretrainedConfig.from_json_file(os.path.join(args.checkpoint_dir, "config.json"))
    architecture = model_config.architecture
    rank_config = copy.deepcopy(model_config)
    rank_config.set_rank(rank)
    model = MODEL_MAP[architecture].from_checkpoint(args.checkpoint_dir, config=rank_config)
    build_config.use_refit = False  # as build_model does with trtllm-build's default kwargs
    engine = tensorrt_llm.builder.build(model, build_config)  # build() deep-copies build_config itself
    if engine is None:
        raise RuntimeError(f"TensorRT-LLM failed to build the engine of rank {rank}; see its log above.")
    engine.save(args.output_dir)
    return rank


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no usable CUDA: the build itself will say so
        return 0


def build_trtllm_engine(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, build: BuildConfig,
                        tp: int | None, tokenizer_dir: str | os.PathLike | None = None, force: bool = False,
                        workers: int = 1) -> Path:
    """Build a TensorRT-LLM engine dir from a checkpoint, as the equivalent `trtllm-build` would: a ReDrafter
    engine from a ReDrafter checkpoint, TensorRT-LLM's auto-regressive engine from a plain LLaMA one.

    Ranks are built one after another, or in a spawned process pool of `workers` (capped at the number of
    GPUs, rank r on GPU r % workers), like trtllm-build's `parallel_build` without MPI.
    """
    from .torch_build import TOKENIZER_FILES, check_checkpoint, copy_tokenizer

    ckpt_dir, out_dir = Path(ckpt_dir).absolute(), Path(out_dir).absolute()
    info = check_checkpoint(ckpt_dir, tp)
    check_buildable(info, build, ckpt_dir)
    if build.dtype and build.dtype != info.model.dtype:
        raise UserError(f"the trtllm backend builds in the checkpoint's dtype ({info.model.dtype}) but "
                        f"--dtype {build.dtype} was asked; re-run convert with --dtype {build.dtype} or drop --dtype.")
    if tokenizer_dir is not None and not any((Path(tokenizer_dir) / f).is_file() for f in TOKENIZER_FILES):
        raise UserError(f"--tokenizer {tokenizer_dir} holds no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}).")
    tensorrt_llm = require_trtllm()
    check_release_accepts(info, str(tensorrt_llm.__version__), ckpt_dir)
    n_workers = max(1, min(workers, _gpu_count() or 1))
    log_level = os.environ.get("TRT_REDRAFTER_TRTLLM_LOG", "info")

    with atomic_output_dir(out_dir, force, what="engine") as tmp:
        argv = trtllm_build_argv(ckpt_dir, tmp, build, info)
        logger.info("building TensorRT-LLM %s engines (tp=%d): trtllm-build %s", tensorrt_llm.__version__,
                    info.tp_size, " ".join(trtllm_build_argv(ckpt_dir, out_dir, build, info)))
        t0 = time.time()
        if n_workers == 1:
            for r in range(info.tp_size):
                _build_rank(r, r % n_workers, argv, log_level)
        else:
            from concurrent.futures import ProcessPoolExecutor
            from multiprocessing import get_context

            with ProcessPoolExecutor(max_workers=n_workers, mp_context=get_context("spawn")) as pool:
                futures = [pool.submit(_build_rank, r, r % n_workers, argv, log_level) for r in range(info.tp_size)]
                errors = [f.exception() for f in futures]
            failed = [(r, e) for r, e in enumerate(errors) if e is not None]
            if failed:
                r, e = failed[0]
                if isinstance(e, UserError):
                    raise e
                raise RuntimeError(f"TensorRT-LLM engine build failed for rank(s) {[r for r, _ in failed]}: {e}") from e
        missing = [f"rank{r}.engine" for r in range(info.tp_size) if not (tmp / f"rank{r}.engine").is_file()]
        if missing or not (tmp / "config.json").is_file():
            raise RuntimeError(f"TensorRT-LLM finished without writing {', '.join(missing) or 'config.json'}.")
        write_json(tmp / MARKER_FILE, {
            "backend": "trtllm",
            "tensorrt_llm_version": str(tensorrt_llm.__version__),
            "trtllm_build_argv": trtllm_build_argv(ckpt_dir, out_dir, build, info),
            "build": build.to_dict(),
        })
        if tokenizer_dir is not None:
            copy_tokenizer(Path(tokenizer_dir), tmp / "tokenizer")
    logger.info("built TensorRT-LLM engine %s (tp=%d, %s) in %.0f s", out_dir, info.tp_size, info.model.dtype,
                time.time() - t0)
    return out_dir


# ---------------------------------------------------------------------------------------------------------------
# Run
# ---------------------------------------------------------------------------------------------------------------
_TRTLLM_NOTE = ("TensorRT-LLM's ModelRunnerCpp does not report per-request steps, acceptance or first-token time; "
                "ms_per_token is batch wall time / this request's output tokens, not TPOT")


def _warn_ignored(args: argparse.Namespace, params: SamplingConfig, greedy_engine: bool) -> None:
    if params.top_k:
        logger.warning("--top-k %d is ignored: TensorRT-LLM ReDrafter engines apply no top-k", params.top_k)
    if params.top_p < 1.0:
        logger.warning("--top-p %g is ignored: TensorRT-LLM ReDrafter engines apply no top-p", params.top_p)
    if params.temperature > 0 and greedy_engine:
        logger.warning("--temperature %g is ignored: this engine was built with redrafter_greedy_search=true "
                       "(re-convert with --no-greedy for sampling)", params.temperature)
    if params.temperature == 0 and not greedy_engine:
        logger.warning("this engine was built with redrafter_greedy_search=false and always samples; "
                       "temperature 0 is not greedy there (TensorRT-LLM's default temperature 1.0 is used)")
    if params.acceptance:
        logger.warning("--acceptance %s is ignored: TensorRT-LLM engines use their own rule (the torch backend's "
                       "'apple')", params.acceptance)


def run_trtllm(args: argparse.Namespace, ecfg) -> int:
    """`trt-redrafter run` on a TensorRT-LLM engine: ModelRunnerCpp (C++ Executor), one process per TP rank.

    Follows examples/run.py of TensorRT-LLM (the ModelRunnerCpp path) and tensorrt_llm/runtime/model_runner_cpp.py.
    """
    from ..prompt_args import load_prompts, resolve_end_id
    from ..runtime.distributed import in_mpi_world, mpirun_command

    redrafter = ecfg.checkpoint.redrafter  # None: a plain (auto-regressive) TensorRT-LLM engine
    if getattr(args, "mode", "redrafter") == "ar" and redrafter is not None:
        raise UserError(f"{args.engine} is a TensorRT-LLM ReDrafter engine, which always decodes speculatively, so "
                        f"--mode ar cannot run on it; for auto-regressive numbers build a plain Llama engine "
                        f"(TensorRT-LLM's examples/models/core/llama/convert_checkpoint.py, then trtllm-build without "
                        f"--speculative_decoding_mode) or build this checkpoint with --backend torch, which runs both modes.")
    if getattr(args, "proposer", None) not in (None, "redrafter"):
        raise UserError(f"{args.engine} is a TensorRT-LLM engine, whose drafts (if any) come from its drafter only; "
                        f"--proposer {args.proposer} runs on torch-backend engines (build-engine --backend torch).")
    tp = ecfg.tp_size
    if tp > 1 and not in_mpi_world():
        return subprocess.call(mpirun_command(tp, args.argv))

    params = SamplingConfig.from_sources(None, args)
    greedy_engine = redrafter.greedy_search if redrafter is not None else params.greedy
    if redrafter is not None:
        _warn_ignored(args, params, greedy_engine)
    tokenizer, prompts = load_prompts(args)
    for prompt in prompts:  # ModelRunnerCpp would answer a raw RuntimeError from its C++ Executor
        ecfg.build.check_request(prompt, params.max_tokens, ecfg.checkpoint.model.vocab_size)
    end_id = resolve_end_id(args, tokenizer)
    end_id = -1 if end_id is None else int(end_id)  # -1: no stop token; outputs are cut by sequence_lengths
    pad_id = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else max(end_id, 0)

    tensorrt_llm = require_trtllm()
    import torch
    from tensorrt_llm.runtime import ModelRunnerCpp

    rank = tensorrt_llm.mpi_rank()
    runner = ModelRunnerCpp.from_dir(engine_dir=str(args.engine), rank=rank)
    sampling = {"random_seed": params.seed}
    if params.temperature > 0 and not greedy_engine:
        sampling["temperature"] = params.temperature
    if redrafter is None:  # the AR engine samples with the request's settings; top_k 1 is greedy
        if params.greedy:
            sampling["top_k"] = 1
        else:
            sampling.update(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
    results = []
    for i in range(0, len(prompts), runner.max_batch_size):
        chunk = prompts[i:i + runner.max_batch_size]
        batch = [torch.tensor(p, dtype=torch.int32) for p in chunk]
        t0 = time.perf_counter()
        with torch.no_grad():
            out = runner.generate(batch, max_new_tokens=params.max_tokens, end_id=end_id, pad_id=pad_id,
                                  streaming=False, return_dict=True, output_sequence_lengths=True, **sampling)
        wall_ms = (time.perf_counter() - t0) * 1e3
        if not out:  # non-leader ranks: the Executor's leader (rank 0) owns requests and results
            continue
        torch.cuda.synchronize()
        ids, lengths = out["output_ids"].cpu(), out["sequence_lengths"].cpu()
        for b, prompt in enumerate(chunk):
            # output_ids[b][0] = prompt + generated tokens, padded; sequence_lengths[b][0] is where it ends
            # (the slicing examples/run.py uses in print_output)
            gen = ids[b, 0, len(prompt):int(lengths[b, 0])].tolist()
            if end_id >= 0 and end_id in gen:
                gen = gen[:gen.index(end_id) + 1]
            stopped = end_id >= 0 and (len(gen) < params.max_tokens or gen[-1:] == [end_id])
            reason = "stop" if stopped else "length"
            if stopped and gen[-1:] != [end_id]:
                # the torch backend keeps the stop token in output_ids; whether TensorRT-LLM's output includes it
                # is not verified, so make both read the same
                gen.append(end_id)
            results.append((gen, reason, wall_ms / max(len(gen), 1)))

    for gen, reason, ms in results:
        text = tokenizer.decode(gen, skip_special_tokens=True) if tokenizer else None
        if args.json:
            rank0_print(json.dumps({"output_ids": gen, "text": text, "finish_reason": reason, "steps": None,
                                    "tokens_per_step": None, "accepted_draft_tokens": None, "draft_tokens": None,
                                    "ttft_ms": None, "ms_per_token": ms, "backend": "trtllm", "note": _TRTLLM_NOTE}),
                        rank=rank)
        else:
            rank0_print(text if text is not None else " ".join(map(str, gen)), rank=rank)
    return 0
