"""build-engine and run through the real CLI: the one-shot form, engine config shape, and refusals."""

from __future__ import annotations

import gc
import json
import re
import subprocess
import sys

import pytest
import torch

from trt_redrafter.cli import main as cli
from trt_redrafter.config import RuntimeConfig, SamplingConfig
from trt_redrafter.errors import UserError
from trt_redrafter.runtime.costs import COST_MODEL_FILE
from trt_redrafter.runtime.distributed import Dist
from trt_redrafter.runtime.engine import Engine
from trt_redrafter.runtime.generate import generate


@pytest.fixture(scope="module")
def engine(tiny_pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("eng") / "engine"
    rc = cli(["build-engine", "--config", "builders/tiny.yaml", "--base-model", str(tiny_pair / "base"),
              "--drafter", str(tiny_pair / "drafter"), "--output", str(out), "--tp", "1"])
    assert rc == 0
    return out


def test_one_shot_build_writes_a_trtllm_shaped_engine(engine):
    cfg = json.loads((engine / "config.json").read_text())
    assert set(cfg) == {"version", "pretrained_config", "build_config"}
    pc, bc = cfg["pretrained_config"], cfg["build_config"]
    assert pc["architecture"] == "ReDrafterForLLaMALM" and pc["redrafter_num_beams"] == 3
    assert bc["backend"] == "torch" and bc["max_batch_size"] == 4 and bc["max_seq_len"] == 128
    assert bc["max_draft_len"] == pc["redrafter_num_beams"] * pc["redrafter_draft_len_per_beam"]
    assert bc["speculative_decoding_mode"] == "explicit_draft_tokens"
    assert (engine / "rank0.safetensors").is_file() and (engine / "tokenizer" / "tokenizer.json").is_file()
    assert not any(p.name.startswith(".") for p in engine.parent.iterdir())  # the temporary checkpoint is gone


def test_run_json_reports_the_documented_fields(engine, capsys):
    assert cli(["run", "--engine", str(engine), "--prompt", "def f(x):", "--max-tokens", "8", "--json",
                "--ignore-eos"]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("output_ids", "text", "tokens_per_step", "accepted_draft_tokens", "steps", "ms_per_token"):
        assert key in doc
    assert len(doc["output_ids"]) == 8 and doc["steps"] == 7



def test_run_decodes_with_the_loaded_heap_frozen_and_thaws_it(engine, monkeypatch):
    """`run` freezes what loading made (engine.freeze_heap: the collector no longer walks it at each collection the
    decode's objects trigger) for its decoding only: in a process that goes on (a test, a notebook), what it loaded is
    the collector's again afterwards."""
    from trt_redrafter.runtime import generate as gen

    seen, real = [], gen.generate
    monkeypatch.setattr(gen, "generate", lambda *a, **k: (seen.append(gc.get_freeze_count()), real(*a, **k))[1])
    assert cli(["run", "--engine", str(engine), "--prompt", "def f(x):", "--max-tokens", "4"]) == 0
    assert seen and seen[0] > 10_000 and gc.get_freeze_count() == 0

def test_an_ar_run_measures_no_step_cost_model(engine):
    """`run --mode ar` decodes auto-regressively only: it measures no step cost model for the speculation policy (tens
    of seconds on a fresh real engine), where a ReDrafter run measures one and keeps it beside the engine. An engine
    loaded for AR requests only refuses a speculative one."""
    model = engine / COST_MODEL_FILE
    model.unlink(missing_ok=True)
    run = ["run", "--engine", str(engine), "--prompt", "def f(x):", "--max-tokens", "4", "--speculate", "auto"]
    assert cli([*run, "--mode", "ar"]) == 0
    assert not model.exists()
    assert cli([*run, "--mode", "redrafter"]) == 0
    assert model.is_file()
    ar_only = Engine.load(engine, Dist(0, 1, torch.device("cpu")), RuntimeConfig(device="cpu", compile="off"),
                          speculative=False)
    assert ar_only.policy.costs is None
    with pytest.raises(UserError, match="auto-regressive requests only"):
        generate(ar_only, [[1, 2, 3]], SamplingConfig(max_tokens=4), "redrafter")


@pytest.mark.parametrize("flag", ["--regex", "--json-object"])
def test_run_follows_a_guide(engine, capsys, flag):
    """`run --regex R` / `--json-object`, ReDrafter and AR: the same tokens, each one accepted by xgrammar's own matcher
    for the guide; the regex's short language is always closed and ended by EOS, where a random model's JSON object
    may still be open after 40 tokens (then the matcher must not have terminated)."""
    import xgrammar
    from transformers import AutoTokenizer

    args = {"--regex": ["--regex", "[a-z]{2,4}-[0-9]{2}"], "--json-object": ["--json-object"]}[flag]
    docs = []
    for mode in ("redrafter", "ar"):
        assert cli(["run", "--engine", str(engine), "--prompt", "def f(x):", "--max-tokens", "40", "--json",
                    "--mode", mode, *args]) == 0
        docs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert docs[0]["output_ids"] == docs[1]["output_ids"] and docs[0]["text"] == docs[1]["text"], docs
    doc, text = docs[0], docs[0]["text"]
    tok = AutoTokenizer.from_pretrained(engine / "tokenizer")
    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok)))
    # --json-object promises a compact object (OpenAI's json_object; runtime/grammar.py writes no other whitespace)
    grammar = (compiler.compile_regex(args[1]) if flag == "--regex" else
               compiler.compile_json_schema('{"type": "object"}', any_whitespace=False))
    matcher = xgrammar.GrammarMatcher(grammar)
    assert all(matcher.accept_token(t) for t in doc["output_ids"]), doc
    if flag == "--regex":
        assert doc["finish_reason"] == "stop" and re.fullmatch(args[1], text), doc
    elif doc["finish_reason"] == "stop":
        assert isinstance(json.loads(text, strict=False), dict), doc
    else:
        assert doc["finish_reason"] == "length" and len(doc["output_ids"]) == 40 and text.startswith("{")
        assert not matcher.is_terminated(), doc


def _refused(argv, capsys, *needles):
    rc = cli(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    for n in needles:
        assert n in err, err
    return err


def test_build_refuses_tp_that_does_not_match_the_checkpoint(tiny_pair, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    assert cli(["convert", "--base-model", str(tiny_pair / "base"), "--drafter", str(tiny_pair / "drafter"),
                "--output", str(ckpt), "--tp", "2", "--dtype", "float32"]) == 0
    _refused(["build-engine", "--checkpoint", str(ckpt), "--output", str(tmp_path / "e"), "--tp", "4"], capsys,
             "--tp 4", "tp=2")
    assert not (tmp_path / "e").exists()


def test_build_refuses_missing_checkpoint_and_existing_output(engine, tmp_path, capsys):
    _refused(["build-engine", "--checkpoint", str(tmp_path / "nope"), "--output", str(tmp_path / "e")], capsys,
             "does not exist")
    _refused(["build-engine", "--checkpoint", str(tmp_path / "nope"), "--output", str(engine)], capsys,
             "already exists", "--force")


@pytest.mark.parametrize("argv,needle", [
    (["--prompt-ids", ",".join(["5"] * 65)], "max_input_len"),
    (["--prompt-ids", "5,6", "--max-tokens", "200"], "max_seq_len"),
    (["--prompt-ids", "5,x"], "not a comma-separated list"),
    (["--prompt-ids", "5,99999"], "outside the vocabulary"),
    (["--prompt-ids", "5", "--temperature", "-1"], "temperature"),
    (["--prompt-ids", "5", "--top-p", "0"], "top_p"),
    (["--prompt-ids", "5", "--regex", "[a-"], "invalid regex guide"),
    (["--prompt-ids", "5", "--json-schema", "/nonexistent.json"], "--json-schema /nonexistent.json: no such file"),
])
def test_run_refuses_bad_requests(engine, capsys, argv, needle):
    _refused(["run", "--engine", str(engine), *argv], capsys, needle)


def test_run_refuses_a_checkpoint_dir_as_engine(tiny_pair, tmp_path, capsys):
    _refused(["run", "--engine", str(tiny_pair / "base"), "--prompt-ids", "5"], capsys, "not an engine directory")


def test_console_script_exit_status(engine):
    proc = subprocess.run([sys.executable, "-m", "trt_redrafter", "run", "--engine", str(engine / "missing"),
                           "--prompt-ids", "5"], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.strip().startswith("error:")
