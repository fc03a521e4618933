"""Qwen bases (families.py): a Qwen2 (q/k/v biases) or Qwen3 (per-head q/k RMSNorms) Hugging Face model plus a
drafter converts to TensorRT-LLM's `ReDrafterForQWenLM` checkpoint (QWenConfig's fields; qkv weight and bias split
per rank as TensorRT-LLM's Qwen converter splits them), and the torch backend decodes it: greedy ReDrafter == AR ==
Hugging Face `generate`, token for token, at TP 1, 2 and 4 (real mpirun ranks), eager and compiled."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine_utils import build_tiny_engines, decode_tp, hf_greedy, load_engine, random_prompts
from test_convert import check_roundtrip, convert
from trt_redrafter.checkpoint.hf import read_hf_model
from trt_redrafter.checkpoint.trtllm_config import parse_checkpoint_config
from trt_redrafter.cli import main as cli
from trt_redrafter.config import SamplingConfig
from trt_redrafter.errors import UserError
from trt_redrafter.runtime.generate import generate

FAMILIES = ("qwen2", "qwen3")
VOCAB = 512
PROMPTS = random_prompts(VOCAB, [4, 9, 6], seed=3)
REPEATED = [(PROMPTS[0] * 4)[:14], *PROMPTS[1:]]  # repeated text: the N-gram proposer's drafts are accepted
RUNS = {"redrafter": {"prompts": PROMPTS}, "ar": {"prompts": PROMPTS, "mode": "ar"},
        "ngram": {"prompts": REPEATED, "proposer": "ngram"}, "ar-repeated": {"prompts": REPEATED, "mode": "ar"}}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_convert_writes_qwens_checkpoint_and_the_shards_rebuild_the_hf_weights(make_tiny_pair, tmp_path, family, tp):
    pair = make_tiny_pair(family=family, num_heads=4, num_kv_heads=2)
    info, ranks = check_roundtrip(pair, convert(pair, tmp_path / "ck", tp), tp)  # biases and q/k norms included
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert cfg["architecture"] == "ReDrafterForQWenLM"
    assert cfg["base_model_architecture"] == {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[family]
    assert cfg["qwen_type"] == family and cfg["seq_length"] == 8192 and cfg["mlp_bias"] is False
    assert cfg["attn_bias"] is (family == "qwen2") and cfg["qk_layernorm"] is False  # qwen3's norms: from qwen_type
    assert info.model.attn_bias is (family == "qwen2") and info.model.qk_layernorm is (family == "qwen3")
    D, kv_rows = 16, max(2 // tp, 1)  # per rank: nh/tp q heads, ceil(kvh/tp) k and v heads (duplicated past kvh)
    qkv = (4 // tp + 2 * kv_rows) * D
    for r in ranks:
        assert r["transformer.layers.0.attention.qkv.weight"].shape == (qkv, 64)
        if family == "qwen2":
            assert r["transformer.layers.0.attention.qkv.bias"].shape == (qkv,)
        else:
            assert "transformer.layers.0.attention.qkv.bias" not in r
            assert r["transformer.layers.1.attention.k_layernorm.weight"].shape == (D,)


def test_a_qwen_base_refuses_the_legacy_format(make_tiny_pair, tmp_path):
    pair = make_tiny_pair(family="qwen2")
    with pytest.raises(UserError, match="takes Llama bases only.*--trtllm-format 1.x"):
        convert(pair, tmp_path / "ck", 1, fmt="legacy")
    assert not (tmp_path / "ck").exists()


def test_a_sliding_window_is_refused_in_one_sentence(make_tiny_pair, tmp_path):
    pair = make_tiny_pair(family="qwen2")
    base = tmp_path / "base"
    shutil.copytree(pair / "base", base)
    cfg = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**cfg, "use_sliding_window": True, "sliding_window": 32}))
    rc = cli(["convert", "--base-model", str(base), "--drafter", str(pair / "drafter"), "--output",
              str(tmp_path / "ck"), "--dtype", "float32"])
    assert rc != 0 and not (tmp_path / "ck").exists()
    with pytest.raises(UserError, match="use_sliding_window is true; this runtime attends to the whole context"):
        read_hf_model(base)


def test_a_qwen3_base_is_refused_by_the_trtllm_backend_before_importing_it(make_tiny_pair, tmp_path):
    """TensorRT-LLM's ReDrafter converter maps Qwen and Qwen2 bases only (examples/redrafter/convert_checkpoint.py
    @31a9cd42, REDRAFTER_MAP): a Qwen3 ReDrafter engine of its own is untested there, so `--backend trtllm` refuses
    it; the torch backend runs it."""
    from trt_redrafter.backends import trtllm
    from trt_redrafter.config import BuildConfig

    pair = make_tiny_pair(family="qwen3")
    ck = convert(pair, tmp_path / "ck", 1)
    info = parse_checkpoint_config(json.loads((ck / "config.json").read_text()), "test")
    with pytest.raises(UserError, match="Qwen3.*REDRAFTER_MAP.*--backend torch"):
        trtllm.check_buildable(info, BuildConfig(max_batch_size=1, max_input_len=8, max_seq_len=32), ck)


@pytest.fixture(scope="module", params=FAMILIES)
def qwen(request, tmp_path_factory):
    """A tiny random Qwen (GQA, untied head) and its engines at TP 1, 2 and 4."""
    base, engines = build_tiny_engines(tmp_path_factory.mktemp(request.param), seed=5, num_beams=4, draft_len=3,
                                       tps=(1, 2, 4), num_heads=4, num_kv_heads=2, vocab_size=VOCAB,
                                       family=request.param)
    return base, engines


@pytest.mark.core
def test_greedy_redrafter_equals_ar_equals_hf_generate_at_tp1(qwen):
    base, engines = qwen
    out = decode_tp(engines[1], RUNS, 1, None)
    hf = [hf_greedy(base, p, 20) for p in PROMPTS]
    assert out["ar"]["output_ids"] == hf
    assert out["redrafter"]["output_ids"] == hf
    assert all(n > 0 for n in out["redrafter"]["draft_tokens"])  # trees were drafted and verified
    assert out["ngram"]["output_ids"] == out["ar-repeated"]["output_ids"]
    assert out["ngram"]["accepted_draft_tokens"][0] > 0  # and drafts accepted


@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI's mpirun is not installed")
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_ranks_give_the_tp1_and_hf_tokens(qwen, tmp_path, tp):
    pytest.importorskip("mpi4py", reason="mpi4py is not installed")
    base, engines = qwen
    out = decode_tp(engines[tp], RUNS, tp, tmp_path)
    hf = [hf_greedy(base, p, 20) for p in PROMPTS]
    assert out["ar"]["output_ids"] == hf and out["redrafter"]["output_ids"] == hf
    assert all(n > 0 for n in out["redrafter"]["draft_tokens"])
    assert out["ngram"]["output_ids"] == out["ar-repeated"]["output_ids"]
    assert out["ngram"]["accepted_draft_tokens"][0] > 0


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("qwen", ["qwen3"], indirect=True)
def test_compiled_greedy_redrafter_equals_hf_generate(qwen):
    """Compiled, the family whose graph departs most from Llama's (per-head q/k norms inside attention). Qwen2's
    q/k/v biases are one add each; its eager tests above run the same model code the graph is traced from, and each
    family's compile takes 75-90 s of the CI's budget. No warm-up: it would compile the device drafter's tree steps
    too, which the n-gram proposer's requests never launch."""
    torch._dynamo.reset()
    base, engines = qwen
    engine = load_engine(engines[1], compile="inductor", warmup=False)
    res = generate(engine, REPEATED, SamplingConfig(max_tokens=20), "redrafter", proposer="ngram")
    assert [r.output_ids for r in res] == [hf_greedy(base, p, 20) for p in REPEATED]
    assert res[0].accepted_draft_tokens > 0
