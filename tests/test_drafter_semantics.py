"""--drafter-semantics is a build setting: the engine records it, the runtime uses it (a run-time value overrides),
greedy output equals AR under either math, and the two maths draft differently."""

from __future__ import annotations

import pytest
import torch

from engine_utils import build_tiny_engines, greedy, load_engine, random_prompts
from trt_redrafter.fsutil import read_json
from trt_redrafter.runtime.generate import generate


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    out = {}
    for semantics in ("apple", "trtllm-0.13"):
        _, e = build_tiny_engines(tmp_path_factory.mktemp(semantics), seed=6, num_beams=3, draft_len=3,
                                  build_args=("--drafter-semantics", semantics))
        out[semantics] = e[1]
    return out


def test_the_engine_records_and_uses_its_drafter_semantics(engines):
    for semantics, path in engines.items():
        assert read_json(path / "config.json", "engine")["build_config"]["drafter_semantics"] == semantics
        assert load_engine(path).drafter.semantics == semantics
    assert load_engine(engines["apple"], drafter_semantics="trtllm-0.13").drafter.semantics == "trtllm-0.13"


def test_greedy_output_equals_ar_under_either_math_and_the_drafts_differ(engines):
    prompts = random_prompts(384, [6, 11, 4], seed=6)
    ar = [r.output_ids for r in generate(load_engine(engines["apple"]), prompts, greedy(16), "ar")]
    drafts = {}
    for semantics, path in engines.items():
        engine = load_engine(path)
        assert [r.output_ids for r in generate(engine, prompts, greedy(16))] == ar, semantics
        emb = torch.randn(2, engine.drafter.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
        drafts[semantics] = engine.drafter.update_state(emb, engine.drafter.init_state(2), step=0)
    # the state after the first drafted token: SiLU(W e + U 0 + b) vs W e
    assert not torch.allclose(drafts["apple"], drafts["trtllm-0.13"])
