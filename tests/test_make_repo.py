"""make-repo: templates filled from the engine's config.json (both engine-model variants), refusals. No server."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from engine_utils import build_tiny_engines
from trt_redrafter.cli import main as cli
from trt_redrafter.errors import UserError
from trt_redrafter.config import RuntimeConfig
from trt_redrafter.serving.contract import PREPROCESSING_INPUTS
from trt_redrafter.serving.repo import TEMPLATES, make_repo

MODELS = ("ensemble", "preprocessing", "postprocessing", "tensorrt_llm")


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Path:
    _, engines = build_tiny_engines(tmp_path_factory.mktemp("mr"), seed=7, num_beams=2, draft_len=3, tps=(2,),
                                    max_batch_size=6, max_seq_len=144)
    return engines[2]


@pytest.fixture(scope="module")
def trtllm_engine(engine, tmp_path_factory) -> Path:
    """The same engine's config.json as a TensorRT-LLM engine directory would carry it (backend trtllm)."""
    d = tmp_path_factory.mktemp("trtllm") / "engine"
    d.mkdir()
    cfg = json.loads((engine / "config.json").read_text())
    del cfg["build_config"]["backend"]  # TensorRT-LLM's config.json has no backend key: read as trtllm
    (d / "config.json").write_text(json.dumps(cfg))
    shutil.copytree(engine / "tokenizer", d / "tokenizer")
    return d


def params(pbtxt: str) -> dict[str, str]:
    return dict(re.findall(r'key:\s*"([^"]+)"\s*value:\s*\{\s*string_value:\s*"((?:[^"\\]|\\.)*)"', pbtxt))


def io_names(pbtxt: str, section: str) -> set[str]:
    block = re.search(rf"^{section} \[(.*?)^\]", pbtxt, re.S | re.M).group(1)
    return set(re.findall(r'name:\s*"([^"]+)"', block))


def test_torch_variant_is_filled_from_the_engine_config(engine, tmp_path):
    repo = tmp_path / "repo"
    make_repo(engine, repo)
    for m in MODELS:
        text = (repo / m / "config.pbtxt").read_text()
        assert "${" not in text, m
        assert "max_batch_size: 6\n" in text, m  # build_config.max_batch_size, in every model
        assert (repo / m / "1").is_dir(), m
    eng = (repo / "tensorrt_llm" / "config.pbtxt").read_text()
    assert 'backend: "python"' in eng and "decoupled: true" in eng
    got = params(eng)
    runtime = json.loads(got.pop("runtime_config").replace('\\"', '"'))  # a pbtxt string holding JSON
    assert got == {"engine_dir": str(engine.absolute()), "tp_size": "2", "exclude_input_in_output": "true"}
    assert RuntimeConfig.from_dict(runtime) == RuntimeConfig()
    assert (repo / "tensorrt_llm" / "1" / "model.py").read_text() == \
        (TEMPLATES / "tensorrt_llm" / "1" / "model.py").read_text()
    for m in ("preprocessing", "postprocessing"):
        assert params((repo / m / "config.pbtxt").read_text())["tokenizer_dir"] == str(engine.absolute() / "tokenizer")
    ens = (repo / "ensemble" / "config.pbtxt").read_text()
    assert '"preceding_output_ids"' in ens and '"PRECEDING_TOKENS"' in ens
    header = eng.splitlines()[0]
    assert "num_beams=2" in header and "draft_len_per_beam=3" in header and "max_seq_len=144" in header


def test_tensorrtllm_variant_is_filled_from_the_engine_config(trtllm_engine, tmp_path):
    repo = tmp_path / "repo"
    spec = make_repo(trtllm_engine, repo)  # default backend: the engine's (trtllm -> tensorrtllm)
    assert spec.backend == "tensorrtllm"
    eng = (repo / "tensorrt_llm" / "config.pbtxt").read_text()
    assert "${" not in eng
    assert 'backend: "tensorrtllm"' in eng and "max_batch_size: 6\n" in eng and "preferred_batch_size: [ 6 ]" in eng
    p = params(eng)
    assert p["decoding_mode"] == "redrafter"
    assert p["gpt_model_type"] == "inflight_fused_batching"
    assert p["gpt_model_path"] == str(trtllm_engine.absolute())
    assert p["max_beam_width"] == "1"
    assert p["max_attention_window_size"] == "144"  # build_config.max_seq_len
    assert p["tokenizer_dir"] == str(trtllm_engine.absolute() / "tokenizer")
    assert "tp=2" in eng.splitlines()[0]
    assert not (repo / "tensorrt_llm" / "1" / "model.py").exists()
    assert (repo / "tensorrt_llm" / "1").is_dir()
    ens = (repo / "ensemble" / "config.pbtxt").read_text()
    assert "preceding_output_ids" not in ens and "PRECEDING_TOKENS" not in ens


@pytest.mark.parametrize("which", ["engine", "trtllm_engine"])
def test_apply_chat_template_reaches_preprocessing(which, request, tmp_path):
    """The optional `apply_chat_template` input (generate --chat, bench): declared by the ensemble and by
    preprocessing, mapped from one to the other, with the template code copied beside preprocessing's model.py."""
    repo = tmp_path / "repo"
    make_repo(request.getfixturevalue(which), repo)
    ens = (repo / "ensemble" / "config.pbtxt").read_text()
    pre = (repo / "preprocessing" / "config.pbtxt").read_text()
    assert re.search(r'name: "apply_chat_template"\s+data_type: TYPE_BOOL\s+dims: \[ 1 \] optional: true', ens)
    assert re.search(r'name: "APPLY_CHAT_TEMPLATE" data_type: TYPE_BOOL dims: \[ 1 \] optional: true', pre)
    assert 'input_map  { key: "APPLY_CHAT_TEMPLATE" value: "apply_chat_template" }' in ens
    assert io_names(pre, "input") == {t.name for t in PREPROCESSING_INPUTS} | {"RETURN_PERF_METRICS",
                                                                               "APPLY_CHAT_TEMPLATE"}
    assert '"APPLY_CHAT_TEMPLATE"' in (repo / "preprocessing" / "1" / "model.py").read_text()
    assert (repo / "preprocessing" / "1" / "trt_redrafter" / "chat.py").is_file()


def test_the_torch_engine_model_declares_whatever_the_cpp_one_does():
    """The torch model declares TensorRT-LLM's whole contract (test_triton_contract.py); the C++ backend variant
    declares what this repository's ensemble uses, so clients of one work with the other."""
    torch_cfg = (TEMPLATES / "tensorrt_llm" / "config.pbtxt").read_text()
    trt_cfg = (TEMPLATES / "tensorrt_llm" / "config.tensorrtllm.pbtxt").read_text()
    assert io_names(trt_cfg, "input") <= io_names(torch_cfg, "input")
    assert io_names(trt_cfg, "output") <= io_names(torch_cfg, "output")


def test_unfilled_placeholder_is_refused(engine, tmp_path):
    templates = tmp_path / "templates"
    shutil.copytree(TEMPLATES, templates)
    cfg = templates / "preprocessing" / "config.pbtxt"
    cfg.write_text(cfg.read_text() + 'parameters { key: "x" value: { string_value: "${not_a_value}" } }\n')
    with pytest.raises(UserError, match=r"preprocessing/config\.pbtxt.*\$\{not_a_value\}"):
        make_repo(engine, tmp_path / "repo", templates=templates)
    assert not (tmp_path / "repo").exists()
    assert not list(tmp_path.glob(".repo.tmp-*"))


def test_backend_mismatch_and_missing_tokenizer_are_refused(engine, tmp_path):
    with pytest.raises(UserError, match="built for the torch backend"):
        make_repo(engine, tmp_path / "a", backend="tensorrtllm")
    with pytest.raises(UserError, match="tokenizer directory"):
        make_repo(engine, tmp_path / "b", tokenizer_dir=tmp_path / "nope")


def test_cli_writes_and_refuses_to_overwrite(engine, tmp_path, capsys):
    out = tmp_path / "repo"
    assert cli(["make-repo", "--engine", str(engine), "--output", str(out), "--compile", "off", "--threads", "1"]) == 0
    runtime = params((out / "tensorrt_llm" / "config.pbtxt").read_text())["runtime_config"]
    assert RuntimeConfig.from_dict(json.loads(runtime.replace('\\"', '"'))) == RuntimeConfig(compile="off", threads=1)
    assert cli(["make-repo", "--engine", str(engine), "--output", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert cli(["make-repo", "--engine", str(engine), "--output", str(out), "--force"]) == 0


def test_word_lists_and_incremental_detokenization(engine):
    from trt_redrafter.serving.text import REPLACEMENT, TextCodec, list_to_words

    codec = TextCodec(engine / "tokenizer")
    words = codec.words_to_list(["hello", "", "the end"])
    assert words.shape[0] == 2 and words.dtype == np.int32
    assert list_to_words(words) == (tuple(codec.tok.encode("hello", add_special_tokens=False)),
                                    tuple(codec.tok.encode("the end", add_special_tokens=False)))
    assert list_to_words(codec.words_to_list([])) == ()
    # a character split over tokens is held back until complete: the deltas add up to the whole text
    ids = codec.tok.encode("naïve café ☕ done", add_special_tokens=False)
    text = "".join(codec.decode_delta(ids[:i], ids[i:i + 1]) for i in range(len(ids)))
    assert text == codec.decode(ids).rstrip(REPLACEMENT)
    assert REPLACEMENT not in text
