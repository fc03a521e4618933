"""The `trtllm` backend (trt_redrafter/backends/trtllm.py).

CPU tests run everywhere without TensorRT-LLM (and without faking it): the module imports lazily, the missing
package is one clear UserError, the equivalent trtllm-build command line, and the refusals that come before
TensorRT-LLM is touched. Tests marked `trtllm` build and run a real TensorRT-LLM engine and skip where
tensorrt_llm is not importable.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from trt_redrafter.backends import trtllm as backend
from trt_redrafter.checkpoint.convert import convert_base_checkpoint
from trt_redrafter.checkpoint.trtllm_config import parse_checkpoint_config
from trt_redrafter.cli import main as cli
from trt_redrafter.config import BuildConfig
from trt_redrafter.errors import UserError
from trt_redrafter.fsutil import read_json

HAVE_TRTLLM = importlib.util.find_spec("tensorrt_llm") is not None
SKIP_REASON = "needs TensorRT-LLM 1.0-1.2 (tensorrt_llm) and an NVIDIA GPU with SM >= 80"
NB, DL = 2, 3


def _cli(*args) -> int:
    return cli([str(a) for a in args])


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> tuple[Path, Path]:
    """(HF base dir with tokenizer, fp16 ReDrafter checkpoint dir) of a tiny random Llama + drafter, with a head size
    TensorRT-LLM's attention plugin builds (32; test_trtllm_sources checks it against the plugin's list)."""
    from test_trtllm_sources import TRTLLM_TINY

    root = tmp_path_factory.mktemp("trtllm-tiny")
    sizes = [a for k, v in TRTLLM_TINY.items() for a in (f"--{k.replace('_', '-')}", v)]
    assert _cli("make-tiny", "--output", root / "tiny", "--seed", 5, *sizes) == 0
    ckpt = root / "ckpt"
    assert _cli("convert", "--base-model", root / "tiny" / "base", "--drafter", root / "tiny" / "drafter",
                "--output", ckpt, "--dtype", "float16", "--num-beams", NB, "--draft-len-per-beam", DL) == 0
    return root / "tiny" / "base", ckpt


# ---- CPU: no TensorRT-LLM needed ---------------------------------------------------------------------------------
def test_module_imports_without_importing_tensorrt_llm():
    code = ("import sys, trt_redrafter.backends.trtllm as m; "
            "assert 'tensorrt_llm' not in sys.modules, 'imported eagerly'; print(m.TRTLLM_SUPPORTED)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ">=1.0,<1.3"


@pytest.mark.skipif(HAVE_TRTLLM, reason="tensorrt_llm is installed here, so the missing-package error cannot happen")
def test_require_trtllm_without_package_is_one_clear_user_error():
    with pytest.raises(UserError) as e:
        backend.require_trtllm()
    msg = str(e.value)
    assert "tensorrt_llm is not installed" in msg
    assert "nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3" in msg
    assert "pip install tensorrt_llm==1.2.* --extra-index-url https://pypi.nvidia.com" in msg
    assert "8.0" in msg and "GPU" in msg
    assert "libopenmpi-dev" in msg and "CUDA_HOME" in msg and "download.pytorch.org/whl/cu" in msg  # TRT-LLM's prerequisites
    assert "\n" not in msg


@pytest.mark.parametrize("version,ok", [("1.0.0", True), ("1.1.0rc0", True), ("1.2.0", True), ("1.2.3", True),
                                        ("1.3.0", False), ("1.3.0rc1", False), ("0.21.0", False),
                                        ("1.0.0rc4", False), ("not-a-version", False)])
def test_version_pin(version, ok):
    assert backend.version_supported(version) is ok


def test_build_argv_is_the_documented_trtllm_build_command(tiny_ckpt, tmp_path):
    _, ckpt = tiny_ckpt
    info = parse_checkpoint_config(read_json(ckpt / "config.json", "ckpt"), "ckpt")
    build = BuildConfig(max_batch_size=4, max_input_len=64, max_seq_len=160)
    argv = backend.trtllm_build_argv(ckpt, tmp_path / "eng", build, info)
    flags = dict(zip(argv[::2], argv[1::2]))
    assert len(flags) * 2 == len(argv)
    assert flags == {
        "--checkpoint_dir": str(ckpt), "--output_dir": str(tmp_path / "eng"), "--gemm_plugin": "float16",
        "--speculative_decoding_mode": "explicit_draft_tokens", "--max_beam_width": "1",
        "--max_batch_size": "4", "--max_input_len": "64", "--max_seq_len": "160",
        "--max_num_tokens": str(build.resolved_max_num_tokens(info.redrafter)),
        "--kv_cache_type": "paged", "--remove_input_padding": "enable", "--context_fmha": "enable",
        "--use_paged_context_fmha": "enable",
    }


def test_build_argv_of_a_plain_checkpoint_is_the_auto_regressive_engine(tiny_ckpt, tmp_path):
    base, _ = tiny_ckpt
    plain = tmp_path / "plain"
    convert_base_checkpoint(base, plain, tp=1, dtype="float16")
    info = parse_checkpoint_config(read_json(plain / "config.json", "ckpt"), "ckpt")
    assert info.redrafter is None
    argv = backend.trtllm_build_argv(plain, tmp_path / "eng", BuildConfig(max_input_len=64, max_seq_len=160), info)
    assert "--speculative_decoding_mode" not in argv and argv[argv.index("--gemm_plugin") + 1] == "float16"


@pytest.mark.skipif(HAVE_TRTLLM, reason="tensorrt_llm is installed here")
def test_build_engine_cli_without_tensorrt_llm_names_what_to_install(tiny_ckpt, tmp_path, capsys):
    _, ckpt = tiny_ckpt
    assert _cli("build-engine", "--checkpoint", ckpt, "--output", tmp_path / "e", "--backend", "trtllm") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tensorrt_llm is not installed" in err[0] and "pip install tensorrt_llm" in err[0]
    assert not (tmp_path / "e").exists()


@pytest.mark.skipif(HAVE_TRTLLM, reason="tensorrt_llm is installed here")
def test_build_without_tensorrt_llm_fails_clearly_and_writes_nothing(tiny_ckpt, tmp_path):
    base, ckpt = tiny_ckpt
    out = tmp_path / "engine"
    with pytest.raises(UserError, match="tensorrt_llm is not installed"):
        backend.build_trtllm_engine(ckpt, out, BuildConfig(max_batch_size=2, max_input_len=32, max_seq_len=96),
                                    None, tokenizer_dir=base)
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".engine")]


def test_build_refuses_a_dtype_other_than_the_checkpoints(tiny_ckpt, tmp_path):
    _, ckpt = tiny_ckpt
    with pytest.raises(UserError, match="checkpoint's dtype"):
        backend.build_trtllm_engine(ckpt, tmp_path / "e", BuildConfig(max_input_len=32, max_seq_len=96,
                                                                      dtype="bfloat16"), None)


def test_build_refuses_a_tp_the_checkpoint_was_not_sharded_for(tiny_ckpt, tmp_path):
    _, ckpt = tiny_ckpt
    with pytest.raises(UserError, match="--tp 2"):
        backend.build_trtllm_engine(ckpt, tmp_path / "e", BuildConfig(max_input_len=32, max_seq_len=96), 2)


@pytest.fixture
def trtllm_marked_engine(tiny_ckpt, tmp_path) -> Path:
    """A torch engine dir whose config says backend trtllm: enough for `run` to route to run_trtllm."""
    base, ckpt = tiny_ckpt
    eng = tmp_path / "engine"
    assert _cli("build-engine", "--checkpoint", ckpt, "--output", eng, "--backend", "torch", "--max-batch-size", 2,
                "--max-input-len", 32, "--max-seq-len", 96, "--tokenizer", base) == 0
    cfg = read_json(eng / "config.json", "engine")
    cfg["build_config"]["backend"] = "trtllm"
    (eng / "config.json").write_text(json.dumps(cfg))
    return eng


def test_run_ar_mode_on_a_redrafter_trtllm_engine_is_refused(trtllm_marked_engine, capsys):
    rc = _cli("run", "--engine", trtllm_marked_engine, "--prompt-ids", "1,2,3", "--mode", "ar")
    assert rc == 2
    err = capsys.readouterr().err
    assert "--mode ar" in err and "plain Llama engine" in err


@pytest.mark.parametrize("argv,needles", [
    (["--prompt-ids", ",".join(["5"] * 33), "--max-tokens", "4"], ("33 tokens", "max_input_len is 32")),
    (["--prompt-ids", "1,2,3", "--max-tokens", "94"], ("max_tokens=94", "max_seq_len=96", "at most 93")),
    (["--prompt-ids", "1,99999", "--max-tokens", "4"], ("99999", "outside the vocabulary")),
])
def test_run_checks_the_request_against_the_trtllm_engines_limits(trtllm_marked_engine, capsys, argv, needles):
    """Before TensorRT-LLM is imported (here it is not installed): ModelRunnerCpp would answer a raw RuntimeError."""
    assert _cli("run", "--engine", trtllm_marked_engine, *argv) == 2
    err = capsys.readouterr().err
    assert all(n in err for n in needles), err
    assert "tensorrt_llm is not installed" not in err


@pytest.mark.skipif(HAVE_TRTLLM, reason="tensorrt_llm is installed here")
def test_run_without_tensorrt_llm_is_one_clear_error(trtllm_marked_engine, capsys):
    rc = _cli("run", "--engine", trtllm_marked_engine, "--prompt-ids", "1,2,3", "--max-tokens", 4)
    assert rc == 2
    assert "tensorrt_llm is not installed" in capsys.readouterr().err


# ---- comparing fp16 TensorRT-LLM with another implementation -------------------------------------------------------
NEAR_TIE = 0.05  # top-1 minus top-2 logit (fp32 reference) below which fp16 kernels may legitimately pick either


def reference_model(model_dir: Path):
    """The fp32 Hugging Face model the near-tie rule measures gaps with (on the CPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()


def top2_margins(model, prompt: list[int], tokens: list[int]) -> list[float]:
    """For each token of `tokens` (greedy continuation of `prompt`), the reference model's top-1 minus top-2 logit
    at the position that chose it."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
    top2 = logits.topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]).tolist()


def assert_greedy_agrees(model_dir: Path, prompts: list[str], got: list[list[int]], want: list[list[int]],
                         tol: float = NEAR_TIE) -> list[int]:
    """`got` equals `want` up to the first near-tie of `want`'s path (a top-2 gap under `tol` in fp32), where
    different but correct kernels (fp16 TensorRT-LLM, fp32 torch, another TP split) may choose either token; past it
    the rest is reported, not asserted. Returns, per prompt, how many tokens were compared."""
    model, compared = reference_model(model_dir), []
    for p, g, w in zip(prompts, got, want):
        margins = top2_margins(model, [int(t) for t in p.split(",")], w)
        n = next((i for i, m in enumerate(margins) if m < tol), len(w))
        assert g[:n] == w[:n], f"prompt {p}: differs before any near-tie (first {n} tokens): {g} vs {w}"
        if g != w:
            print(f"prompt {p}: identical for {n} tokens; after the near-tie at {n} (gap {margins[n]:.4f}) they "
                  f"differ: {g[n:]} vs {w[n:]}")
        compared.append(n)
    return compared


def test_near_tie_comparison_asserts_up_to_the_first_near_tie_only(tmp_path):
    """The rule the GPU comparisons use, on the CPU (a tiny random Llama, HF fp32): with no tolerance every token is
    compared; a difference before the first near-tie fails; after it, it is reported."""
    import torch

    assert _cli("make-tiny", "--output", tmp_path / "tiny", "--seed", 3) == 0
    base = tmp_path / "tiny" / "base"
    model = reference_model(base)
    prompt = [1, 17, 42, 5]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
    margins = top2_margins(model, prompt, out)
    assert len(margins) == 12 and min(margins) >= 0
    assert assert_greedy_agrees(base, ["1,17,42,5"], [out], [out], tol=0.0) == [12]
    k = sorted(range(12), key=lambda i: margins[i])[0]  # the smallest gap of the path
    flipped = out[:k] + [(out[k] + 1) % 64] + out[k + 1:]
    assert assert_greedy_agrees(base, ["1,17,42,5"], [flipped], [out], tol=margins[k] + 1e-6) == [k]
    with pytest.raises(AssertionError, match="differs before any near-tie"):
        assert_greedy_agrees(base, ["1,17,42,5"], [flipped], [out], tol=0.0)


# ---- real TensorRT-LLM ------------------------------------------------------------------------------------------
LIMITS = BuildConfig(max_batch_size=4, max_input_len=64, max_seq_len=160)


def _require_trtllm_gpu() -> None:
    pytest.importorskip("tensorrt_llm", reason=SKIP_REASON)
    import torch

    if not torch.cuda.is_available():
        pytest.skip(SKIP_REASON)


@pytest.fixture(scope="module")
def trtllm_engine(tiny_ckpt, tmp_path_factory) -> Path:
    _require_trtllm_gpu()
    base, ckpt = tiny_ckpt
    out = tmp_path_factory.mktemp("trtllm-engine") / "engine"
    backend.build_trtllm_engine(ckpt, out, LIMITS, None, tokenizer_dir=base)
    return out


@pytest.mark.trtllm
@pytest.mark.gpu
@pytest.mark.slow
def test_trtllm_build_of_tiny_checkpoint(trtllm_engine):
    from trt_redrafter.checkpoint.engine_config import load_engine_config

    assert (trtllm_engine / "rank0.engine").is_file()
    assert (trtllm_engine / "tokenizer" / "tokenizer.json").is_file()
    marker = read_json(trtllm_engine / backend.MARKER_FILE, "marker")
    assert marker["backend"] == "trtllm" and backend.version_supported(marker["tensorrt_llm_version"])
    cfg = read_json(trtllm_engine / "config.json", "engine")
    bc = cfg["build_config"]
    assert "backend" not in bc  # TensorRT-LLM's config.json is left as TensorRT-LLM wrote it
    assert bc["max_draft_len"] == NB * DL
    assert bc["max_beam_width"] == 1 and bc["max_batch_size"] == 4
    assert str(bc["speculative_decoding_mode"]).lower().endswith(("explicit_draft_tokens", "16"))
    assert cfg["pretrained_config"]["architecture"] == "ReDrafterForLLaMALM"
    assert load_engine_config(trtllm_engine).backend == "trtllm"
    assert not [p for p in trtllm_engine.parent.iterdir() if p.name.startswith(".engine")]


def _run_json(engine: Path, prompts: list[str], max_tokens: int, *extra) -> list[dict]:
    proc = subprocess.run([sys.executable, "-m", "trt_redrafter", "run", "--engine", str(engine), "--prompt-ids",
                           *prompts, "--max-tokens", str(max_tokens), "--ignore-eos", "--json", *extra],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.mark.trtllm
@pytest.mark.gpu
@pytest.mark.slow
def test_trtllm_greedy_equals_torch_backend_greedy(trtllm_engine, tiny_ckpt, tmp_path):
    base, ckpt = tiny_ckpt
    torch_engine = tmp_path / "torch-engine"
    assert _cli("build-engine", "--checkpoint", ckpt, "--output", torch_engine, "--backend", "torch",
                "--max-batch-size", 4, "--max-input-len", 64, "--max-seq-len", 160, "--tokenizer", base) == 0
    prompts = ["1,17,42,5,9", "3,3,8", "200,11,7,64,2,90,31"]
    got = _run_json(trtllm_engine, prompts, 24)
    want = _run_json(torch_engine, prompts, 24)
    # fp16 TensorRT-LLM against the fp32-reference path: equal up to the first near-tie (top-2 gap < NEAR_TIE)
    assert_greedy_agrees(base, prompts, [d["output_ids"] for d in got], [d["output_ids"] for d in want])
    assert all(len(d["output_ids"]) == 24 and d["finish_reason"] == "length" for d in got)
    assert all(d["backend"] == "trtllm" and d["ms_per_token"] > 0 for d in got)


@pytest.fixture(scope="module")
def trtllm_ar_engine(tiny_ckpt, tmp_path_factory) -> Path:
    """TensorRT-LLM's auto-regressive engine of the same base (a plain LLaMA checkpoint through the same build)."""
    _require_trtllm_gpu()
    base, _ = tiny_ckpt
    root = tmp_path_factory.mktemp("trtllm-ar")
    convert_base_checkpoint(base, root / "plain", tp=1, dtype="float16")
    return backend.build_trtllm_engine(root / "plain", root / "engine", LIMITS, None, tokenizer_dir=base)


@pytest.mark.trtllm
@pytest.mark.gpu
@pytest.mark.slow
def test_trtllm_greedy_redrafter_equals_trtllm_greedy_ar(trtllm_engine, trtllm_ar_engine, tiny_ckpt):
    prompts = ["1,17,42,5,9", "3,3,8", "200,11,7,64,2,90,31"]
    # the same fp16 weights through different kernels (tree attention vs AR): equal up to the first near-tie
    assert_greedy_agrees(tiny_ckpt[0], prompts, [d["output_ids"] for d in _run_json(trtllm_engine, prompts, 24)],
                         [d["output_ids"] for d in _run_json(trtllm_ar_engine, prompts, 24)])


@pytest.mark.trtllm
@pytest.mark.gpu
@pytest.mark.slow
def test_trtllm_tp2_equals_tp1(trtllm_engine, tiny_ckpt, tmp_path):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("TP=2 needs two GPUs")
    base, _ = tiny_ckpt
    ckpt2 = tmp_path / "ckpt-tp2"
    assert _cli("convert", "--base-model", base, "--drafter", base.parent / "drafter", "--output", ckpt2,
                "--dtype", "float16", "--tp", 2, "--num-beams", NB, "--draft-len-per-beam", DL) == 0
    eng2 = backend.build_trtllm_engine(ckpt2, tmp_path / "engine-tp2", LIMITS, 2, tokenizer_dir=base)
    prompts = ["1,17,42,5,9", "3,3,8"]
    assert_greedy_agrees(base, prompts, [d["output_ids"] for d in _run_json(eng2, prompts, 24)],
                         [d["output_ids"] for d in _run_json(trtllm_engine, prompts, 24)])


@pytest.mark.trtllm
@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not Path("/opt/tritonserver/backends/tensorrtllm").is_dir(),
                    reason="needs TensorRT-LLM's Triton backend (NGC tritonserver:<yy.mm>-trtllm-python-py3 container)")
def test_tensorrtllm_triton_model_serves_a_request(trtllm_engine, tmp_path):
    from trt_redrafter.runtime.distributed import free_port
    from trt_redrafter.serving.client import GenerationRequest, generate_one
    from trt_redrafter.serving.launcher import TritonServer
    from trt_redrafter.serving.repo import make_repo

    make_repo(trtllm_engine, tmp_path / "repo")
    want = _run_json(trtllm_engine, ["1,17,42,5,9"], 16)[0]["output_ids"]
    with TritonServer(tmp_path / "repo", grpc_port=free_port(), http_port=free_port(),
                      metrics_port=free_port()) as srv:
        res = generate_one(srv.grpc_url, GenerationRequest(prompt_ids=[1, 17, 42, 5, 9], max_tokens=16, end_id=-1),
                           model="tensorrt_llm", timeout=120)
    assert res.error is None and res.output_ids == want
    assert res.stats["total_draft_tokens"] > 0  # return_perf_metrics reached the backend
