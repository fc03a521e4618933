"""What TensorRT-LLM 1.0-1.2 and its Triton backend require of the files this project writes, checked on the CPU.

The facts are kept here as data, each with the source file (and commit) it was read from, so these tests do not
take the project's own tables on trust:
- the parameters tensorrtllm_backend's C++ model reads without a fallback (model_instance_state.cc),
- the outputs it sends to a request that sets return_perf_metrics,
- the constructor signatures that rebuild a checkpoint's `mapping` and `quantization` (cls(**d): an unknown key
  is a TypeError),
- the head sizes TensorRT-LLM's attention plugin builds.
Nothing here imports or imitates TensorRT-LLM.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from engine_utils import build_tiny_engines
from trt_redrafter.backends import trtllm as backend
from trt_redrafter.checkpoint.trtllm_config import build_pretrained_config
from trt_redrafter.cli import main as cli
from trt_redrafter.config import BuildConfig, DrafterConfig, ModelConfig, ReDrafterConfig
from trt_redrafter.errors import UserError
from trt_redrafter.fsutil import read_json
from trt_redrafter.serving.repo import make_repo

BACKEND_SRC = "triton-inference-server/tensorrtllm_backend inflight_batcher_llm/src/model_instance_state.cc"
# (parameter, values the backend accepts; None: any string) read outside any try/catch, so a missing one stops the
# instance: @c2e65b8 (and v0.19.0 c1e1963, same lines) L62 gpt_model_type, L413-415 the other three.
REQUIRED_PARAMETERS = {
    "gpt_model_type": {"V1", "v1", "inflight_batching", "inflight_fused_batching"},  # L72-77: anything else throws
    "tokenizer_dir": None,
    "xgrammar_tokenizer_info_path": None,
    "guided_decoding_backend": None,
}
# read inside try/catch, but L771-772 requires one of gpt_model_path / encoder_model_path to name an existing path
# bool parameters accept only these (model_state.cc L310-326)
BOOLS = {"True", "true", "TRUE", "1", "False", "false", "FALSE", "0"}
BOOL_PARAMETERS = ("exclude_input_in_output", "kv_cache_onboard_blocks", "enable_kv_cache_reuse", "multi_block_mode",
                   "enable_chunked_context", "normalize_log_probs", "cuda_graph_mode", "enable_context_fmha_fp32_acc",
                   "speculative_decoding_fast_logits")
# fillTritonResponse (L1255-1305) sends these when the request sets return_perf_metrics (names and types from the
# stock all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt @ c2e65b8 L530-578); Triton refuses an output a
# model's config does not declare.
PERF_METRIC_OUTPUTS = {"kv_cache_alloc_new_blocks": "TYPE_INT32", "kv_cache_reused_blocks": "TYPE_INT32",
                       "kv_cache_alloc_total_blocks": "TYPE_INT32", "arrival_time_ns": "TYPE_INT64",
                       "first_scheduled_time_ns": "TYPE_INT64", "first_token_time_ns": "TYPE_INT64",
                       "last_token_time_ns": "TYPE_INT64", "acceptance_rate": "TYPE_FP32",
                       "total_accepted_draft_tokens": "TYPE_INT32", "total_draft_tokens": "TYPE_INT32"}

# NVIDIA/TensorRT-LLM constructor parameters (keyword names), per release line.
# Mapping.__init__ (tensorrt_llm/mapping.py): @05ebebb2 for the 1.0 era; @b35ac1b6 (version.py: 1.2.0rc2) for 1.2;
# 1.1 = 1.0 + enable_lm_head_tp_in_adp (PR #7571, merged while main was 1.1.0rc), auto_parallel removed after the
# 1.1 branch (PR #8329).
_MAPPING_1_0 = ("world_size", "rank", "gpus_per_node", "cp_size", "cp_config", "tp_size", "pp_size", "moe_cluster_size",
                "moe_tp_size", "moe_ep_size", "attn_tp_size", "attn_cp_size", "auto_parallel", "enable_attention_dp")
MAPPING_INIT = {
    "1.0": _MAPPING_1_0,
    "1.1": _MAPPING_1_0 + ("enable_lm_head_tp_in_adp",),
    "1.2": tuple(k for k in _MAPPING_1_0 if k != "auto_parallel") + ("enable_lm_head_tp_in_adp",),
}
# QuantConfig dataclass fields (tensorrt_llm/models/modeling_utils.py): @01ea6d79 has no mamba_ssm_cache_dtype,
# @b35ac1b6 (1.2.0rc2) has it; for 1.0 and 1.1 it could not be dated, so it counts as absent.
_QUANT = ("quant_algo", "kv_cache_quant_algo", "group_size", "smoothquant_val", "clamp_val", "use_meta_recipe",
          "has_zero_point", "pre_quant_scale", "exclude_modules")
QUANT_FIELDS = {"1.0": _QUANT, "1.1": _QUANT, "1.2": _QUANT + ("mamba_ssm_cache_dtype",)}
# cpp/tensorrt_llm/kernels/decoderMaskedMultiheadAttention.cu MMHA_SUPPORTED_HEAD_SIZES; attentionOp.cpp aborts the
# build with "Head size %d is not supported by MMHA" for any other
MMHA_SUPPORTED_HEAD_SIZES = {32, 48, 64, 80, 96, 104, 112, 128, 144, 160, 192, 224, 256}
# the shapes of this file's (and test_trtllm_backend's) TensorRT-LLM fixtures: head size 128 / 4 = 32
TRTLLM_TINY = dict(hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256)


def params(pbtxt: str) -> dict[str, str]:
    return dict(re.findall(r'key:\s*"([^"]+)"\s*value:\s*\{\s*string_value:\s*"((?:[^"\\]|\\.)*)"', pbtxt))


def io(pbtxt: str, section: str) -> dict[str, str]:
    block = re.search(rf"^{section} \[(.*?)^\]", pbtxt, re.S | re.M).group(1)
    return dict(re.findall(r'name:\s*"([^"]+)"\s*data_type:\s*(\w+)', block))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """A TensorRT-LLM-shaped tiny pair (head size 32): HF base, fp16 checkpoints in both formats, a torch engine
    re-labelled as TensorRT-LLM's (its config.json without build_config.backend) for make-repo."""
    root = tmp_path_factory.mktemp("trtllm-src")
    base, engines = build_tiny_engines(root, seed=3, num_beams=2, draft_len=2, tps=(1,), dtype="float16",
                                       **TRTLLM_TINY)
    eng = root / "trtllm-engine"
    eng.mkdir()
    cfg = json.loads((engines[1] / "config.json").read_text())
    del cfg["build_config"]["backend"]
    (eng / "config.json").write_text(json.dumps(cfg))
    shutil.copytree(engines[1] / "tokenizer", eng / "tokenizer")
    legacy = root / "ckpt-legacy"
    assert cli(["convert", "--base-model", str(base), "--drafter", str(root / "tiny" / "drafter"), "--output",
                str(legacy), "--dtype", "float16", "--trtllm-format", "legacy"]) == 0
    return {"root": root, "base": base, "ckpt": root / "ckpt-tp1", "legacy": legacy, "engine": eng}


# ---- 1. the tensorrtllm model loads: every parameter the backend requires ------------------------------------
def test_tensorrtllm_model_has_every_parameter_the_backend_reads_without_a_fallback(tiny, tmp_path):
    make_repo(tiny["engine"], tmp_path / "repo")
    p = params((tmp_path / "repo" / "tensorrt_llm" / "config.pbtxt").read_text())
    for name, allowed in REQUIRED_PARAMETERS.items():
        assert name in p, f"{name} missing: {BACKEND_SRC} throws 'Cannot find parameter with name: {name}'"
        assert allowed is None or p[name] in allowed, (name, p[name])
    assert Path(p["gpt_model_path"]).is_dir() and (Path(p["gpt_model_path"]) / "config.json").is_file()
    assert Path(p["tokenizer_dir"]) == tiny["engine"].absolute() / "tokenizer"
    # guided decoding: both empty means off (L424-428); one set alone would make the backend check a path
    assert p["guided_decoding_backend"] == p["xgrammar_tokenizer_info_path"] == ""
    assert p["decoding_mode"] == "redrafter"  # -> DecodingMode::ExplicitDraftTokens (L569-572)
    for name in BOOL_PARAMETERS:
        assert name not in p or p[name] in BOOLS, (name, p[name])
    # prefix reuse and chunked prefill, as the runtime flags say (both on by default, as for the torch engine)
    assert (p["enable_kv_cache_reuse"], p["enable_chunked_context"]) == ("true", "true")
    from trt_redrafter.config import RuntimeConfig
    make_repo(tiny["engine"], tmp_path / "repo-off", runtime=RuntimeConfig(kv_cache_reuse=False,
                                                                           enable_chunked_context=False))
    off = params((tmp_path / "repo-off" / "tensorrt_llm" / "config.pbtxt").read_text())
    assert (off["enable_kv_cache_reuse"], off["enable_chunked_context"]) == ("false", "false")


def test_tensorrtllm_scalar_inputs_are_shaped_as_the_backend_batches_them(tiny, tmp_path):
    """utils.cc splitBatchInputsTensors @ c2e65b8: a batch of requests needs input_lengths, 1-D; the stock config
    reshapes every [1] input to [] (all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt)."""
    make_repo(tiny["engine"], tmp_path / "repo")
    text = (tmp_path / "repo" / "tensorrt_llm" / "config.pbtxt").read_text()
    block = re.search(r"^input \[(.*?)^\]", text, re.S | re.M).group(1)
    entries = {re.search(r'name:\s*"(\w+)"', e).group(1): e for e in re.findall(r"\{[^{}]*(?:\{[^{}]*\}[^{}]*)*\}", block)}
    for name, entry in entries.items():
        # as the stock config: ragged [1] inputs and mrope_position_deltas keep their dims
        if "dims: [ 1 ]" in entry and "allow_ragged_batch" not in entry and name != "mrope_position_deltas":
            assert "reshape: { shape: [ ] }" in entry, name
    assert "optional" not in entries["input_lengths"]


# ---- 3. acceptance statistics: the ensemble asks for them, the model declares what the backend sends ------------
def test_tensorrtllm_model_declares_every_perf_metric_output(tiny, tmp_path):
    make_repo(tiny["engine"], tmp_path / "repo")
    text = (tmp_path / "repo" / "tensorrt_llm" / "config.pbtxt").read_text()
    outputs = io(text, "output")
    for name, dtype in PERF_METRIC_OUTPUTS.items():
        assert outputs.get(name) == dtype, name
    assert io(text, "input").get("return_perf_metrics") == "TYPE_BOOL"


def test_ensemble_sets_return_perf_metrics_on_the_engine_request(tiny, tmp_path):
    make_repo(tiny["engine"], tmp_path / "repo")
    ens = (tmp_path / "repo" / "ensemble" / "config.pbtxt").read_text()
    steps = {m.group(1): m.group(0) for m in re.finditer(r'model_name:\s*"(\w+)".*?\n    \}', ens, re.S)}
    engine_in = dict(re.findall(r'input_map\s*\{\s*key:\s*"(\w+)"\s*value:\s*"(\w+)"', steps["tensorrt_llm"]))
    pre_out = dict(re.findall(r'output_map\s*\{\s*key:\s*"(\w+)"\s*value:\s*"(\w+)"', steps["preprocessing"]))
    pre_in = dict(re.findall(r'input_map\s*\{\s*key:\s*"(\w+)"\s*value:\s*"(\w+)"', steps["preprocessing"]))
    # the engine's return_perf_metrics comes from preprocessing (present on every request, default true) ...
    assert engine_in["return_perf_metrics"] == pre_out["OUT_RETURN_PERF_METRICS"]
    # ... which takes the client's optional return_perf_metrics
    assert pre_in["RETURN_PERF_METRICS"] == "return_perf_metrics"
    assert io(ens, "input")["return_perf_metrics"] == "TYPE_BOOL"
    pre = (tmp_path / "repo" / "preprocessing" / "1" / "model.py").read_text()
    assert '_rows(request, "RETURN_PERF_METRICS", True, bool, b)' in pre  # default true, one per prompt


# ---- 2. the checkpoint loads in every supported release ----------------------------------------------------------
@pytest.mark.parametrize("line", sorted(MAPPING_INIT))
def test_checkpoint_mapping_and_quantization_keys_are_accepted_by_each_release(line):
    m = ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=2,
                    num_attention_heads=32, num_key_value_heads=32, head_size=128, dtype="float16")
    cfg = build_pretrained_config(m, DrafterConfig(vocab_size=32000, hidden_size=4096, exit_dim=8192,
                                                   num_draft_layers=2), ReDrafterConfig(), tp=4)
    assert set(cfg["mapping"]) <= set(MAPPING_INIT[line]), set(cfg["mapping"]) - set(MAPPING_INIT[line])
    assert set(cfg["quantization"]) <= set(QUANT_FIELDS[line]), set(cfg["quantization"]) - set(QUANT_FIELDS[line])
    assert cfg["mapping"]["tp_size"] == 4 and cfg["mapping"]["world_size"] == 4


def test_a_checkpoint_with_keys_the_installed_release_rejects_is_one_clear_error(tiny, tmp_path):
    from trt_redrafter.checkpoint.trtllm_config import parse_checkpoint_config

    raw = read_json(tiny["ckpt"] / "config.json", "ckpt")
    raw["mapping"]["auto_parallel"] = False  # what earlier versions of this project wrote
    info = parse_checkpoint_config(raw, "ckpt")
    backend.check_release_accepts(info, "1.1.0", tmp_path)  # 1.1 still takes it
    with pytest.raises(UserError, match=r"mapping\.auto_parallel.*1\.2\.0rc2"):
        backend.check_release_accepts(info, "1.2.0rc2", tmp_path)


# ---- 4. fixture shapes the attention plugin builds; other head sizes refused before TensorRT-LLM ----------------
def test_trtllm_fixture_head_size_is_one_the_attention_plugin_supports(tiny):
    cfg = read_json(tiny["ckpt"] / "config.json", "ckpt")
    assert cfg["head_size"] in MMHA_SUPPORTED_HEAD_SIZES
    assert set(backend.MMHA_HEAD_SIZES) == MMHA_SUPPORTED_HEAD_SIZES


def test_build_refuses_a_head_size_the_attention_plugin_lacks_before_importing_tensorrt_llm(tmp_path):
    root = tmp_path / "t"
    base, _ = build_tiny_engines(root, seed=1, num_beams=2, draft_len=2, tps=())  # head size 64 / 4 = 16
    ckpt = tmp_path / "ckpt"
    assert cli(["convert", "--base-model", str(base), "--drafter", str(root / "tiny" / "drafter"), "--output",
                str(ckpt), "--dtype", "float16"]) == 0
    with pytest.raises(UserError, match=r"head size 16 .*attention plugin"):
        backend.build_trtllm_engine(ckpt, tmp_path / "e", BuildConfig(max_input_len=32, max_seq_len=96), None)
    assert not (tmp_path / "e").exists()


# ---- 5. a legacy checkpoint on a 1.x build: one sentence, not a KeyError from PretrainedConfig.from_dict ---------
def test_build_refuses_a_legacy_checkpoint_before_importing_tensorrt_llm(tiny, tmp_path):
    with pytest.raises(UserError, match=r"ReDrafterForCausalLM.*--trtllm-format 1\.x"):
        backend.build_trtllm_engine(tiny["legacy"], tmp_path / "e", BuildConfig(max_input_len=32, max_seq_len=96),
                                    None)


def test_build_refuses_the_pre_0_14_drafter_math(tiny, tmp_path):
    with pytest.raises(UserError, match=r"trtllm-0\.13.*--backend torch"):
        backend.build_trtllm_engine(tiny["ckpt"], tmp_path / "e", BuildConfig(max_input_len=32, max_seq_len=96,
                                                                              drafter_semantics="trtllm-0.13"), None)


# ---- serving a tensorrtllm repository --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tp2_repo(tiny, tmp_path_factory) -> Path:
    """A tensorrtllm repository of a TP=2 TensorRT-LLM engine directory (config.json only: enough for make-repo and
    the launcher, which read nothing else)."""
    root = tmp_path_factory.mktemp("tp2")
    eng = root / "engine"
    shutil.copytree(tiny["engine"], eng)
    cfg = json.loads((eng / "config.json").read_text())
    cfg["pretrained_config"]["mapping"].update(world_size=2, tp_size=2, moe_tp_size=2, attn_tp_size=2)
    (eng / "config.json").write_text(json.dumps(cfg))
    make_repo(eng, root / "repo")
    return root / "repo"


def test_serve_launches_one_tritonserver_per_rank_as_launch_triton_server_does(tp2_repo):
    from trt_redrafter.serving.launcher import TritonServer

    srv = TritonServer(tp2_repo, grpc_port=9001, http_port=9000, metrics_port=9002)
    assert (srv.engine_backend, srv.world_size) == ("tensorrtllm", 2)
    binary = Path("/opt/tritonserver/bin/tritonserver")
    cmd = srv.command(binary, None)
    assert Path(cmd[0]).name == "mpirun" and "-n" not in cmd[:cmd.index(str(binary)) - 2]
    apps, cur = [], []
    for a in cmd[cmd.index("-n"):]:
        if a == ":":
            apps.append(cur)
            cur = []
        else:
            cur.append(a)
    apps.append(cur)
    assert len(apps) == 2 and all(a[:3] == ["-n", "1", str(binary)] for a in apps)
    for rank, app in enumerate(apps):
        assert f"--model-repository={tp2_repo}" in app and "--disable-auto-complete-config" in app
        # every rank gets the same ports (the leader serves; the others never leave the engine's model load)
        assert {"--grpc-port=9001", "--http-port=9000", "--metrics-port=9002"} <= set(app)
        assert f"--backend-config=python,shm-region-prefix-name={srv.shm_prefix}{rank}_" in app
        explicit = {"--model-control-mode=explicit", "--load-model=tensorrt_llm"} <= set(app)
        assert explicit == (rank > 0), (rank, app)


@pytest.mark.skipif(Path("/opt/tritonserver/backends/tensorrtllm").is_dir(),
                    reason="TensorRT-LLM's Triton backend is installed here")
def test_serving_a_tensorrtllm_repository_without_its_backend_is_one_clear_error(tp2_repo, capsys):
    assert cli(["serve", "--repo", str(tp2_repo), "--ready-timeout", "5"]) == 2
    err = capsys.readouterr().err
    assert "TensorRT-LLM's Triton backend" in err and "-trtllm-python-py3" in err and "Traceback" not in err


@pytest.mark.server
@pytest.mark.core
def test_text_models_run_from_the_repository_alone_in_a_real_tritonserver(tp2_repo, tmp_path):
    """The pre/postprocessing models carry their own code (a stock NGC container has no trt-redrafter): they load
    with no PYTHONPATH, from the files beside their model.py, and preprocessing asks the engine for the acceptance
    statistics unless the client says otherwise."""
    import subprocess
    import sys

    import numpy as np
    import tritonclient.grpc as grpcclient

    from trt_redrafter.runtime.distributed import free_port
    from trt_redrafter.serving.launcher import _bundled_backends, find_tritonserver, server_env
    from trt_redrafter.serving.text import TextCodec

    here = tp2_repo / "preprocessing" / "1"
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); import trt_redrafter.serving.text as t, "
             "trt_redrafter.errors as e; print(t.__file__); print(e.__file__)")
    files = subprocess.run([sys.executable, "-c", probe, str(here)], capture_output=True, text=True, check=True)
    assert all(line.startswith(str(here)) for line in files.stdout.split()), files.stdout

    binary, bundled = find_tritonserver()
    backends = _bundled_backends(binary.parents[1], tmp_path / "backends") if bundled else None
    env = server_env(bundled)
    env.pop("PYTHONPATH", None)
    grpc, http = free_port(), free_port()
    cmd = [str(binary), f"--model-repository={tp2_repo}", "--disable-auto-complete-config",
           "--model-control-mode=explicit", "--load-model=preprocessing", "--load-model=postprocessing",
           f"--grpc-port={grpc}", f"--http-port={http}", f"--metrics-port={free_port()}",
           f"--backend-config=python,shm-region-prefix-name=trtrdtest{grpc}_"]
    if backends is not None:
        cmd.append(f"--backend-directory={backends}")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc}")
    try:
        import time

        deadline = time.monotonic() + 120
        while not (proc.poll() is None and _ready(client)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()[-3000:]
            time.sleep(0.2)
        codec = TextCodec(tp2_repo.parent / "engine" / "tokenizer")
        for flag, want in ((None, True), (False, False)):
            q = grpcclient.InferInput("QUERY", [1, 1], "BYTES")
            q.set_data_from_numpy(np.array([["hello world"]], dtype=object))
            n = grpcclient.InferInput("REQUEST_OUTPUT_LEN", [1, 1], "INT32")  # required, as in TensorRT-LLM's model
            n.set_data_from_numpy(np.array([[8]], np.int32))
            inputs = [q, n]
            if flag is not None:
                f = grpcclient.InferInput("RETURN_PERF_METRICS", [1, 1], "BOOL")
                f.set_data_from_numpy(np.array([[flag]]))
                inputs.append(f)
            out = client.infer("preprocessing", inputs)
            assert out.as_numpy("INPUT_ID")[0].tolist() == codec.encode("hello world")
            assert out.as_numpy("OUT_RETURN_PERF_METRICS").reshape(-1).tolist() == [want]
    finally:
        client.close()
        proc.send_signal(2)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        for p in Path("/dev/shm").glob(f"trtrdtest{grpc}_*"):
            p.unlink()


def _ready(client) -> bool:
    try:
        return client.is_model_ready("preprocessing") and client.is_model_ready("postprocessing")
    except Exception:  # noqa: BLE001 - not up yet
        return False
