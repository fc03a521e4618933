"""CUDA: the torch backend gives the same greedy tokens on the GPU as on the CPU and as HF `generate`, eager and
under CUDA graphs; sampled ReDrafter equals sampled AR for the same seed; the Triton kernels agree with their
PyTorch oracles at realistic shapes (tests/test_plugins.py runs them on CPU under the interpreter)."""

from __future__ import annotations

import pytest
import torch

from engine_utils import build_tiny_engines, greedy, hf_greedy, load_engine, random_prompts
from trt_redrafter.config import SamplingConfig
from trt_redrafter.runtime.generate import generate

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPT_LENS = [5, 12, 3, 9, 17]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base, engines = build_tiny_engines(tmp_path_factory.mktemp("gpu"), seed=2, num_beams=6, draft_len=4,
                                       hidden_size=128, num_heads=4, num_kv_heads=2, max_batch_size=4)
    prompts = random_prompts(384, PROMPT_LENS, seed=1)
    cpu_ar = [r.output_ids for r in generate(load_engine(engines[1]), prompts, greedy(24), "ar")]
    return base, engines[1], prompts, cpu_ar


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("compile", ["off", "cudagraphs"])
@pytest.mark.parametrize("mode", ["ar", "redrafter"])
def test_cuda_greedy_matches_cpu_and_hf(tiny, mode, compile, kernels):
    base, engine_dir, prompts, cpu_ar = tiny
    engine = load_engine(engine_dir, device="cuda", compile=compile, kernels=kernels)
    out = [r.output_ids for r in generate(engine, prompts, greedy(24), mode)]
    assert out == cpu_ar
    assert out == [hf_greedy(base, p, 24) for p in prompts]
    assert engine.cache.used_blocks == 0


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_cuda_sampled_redrafter_equals_sampled_ar(tiny, kernels):
    _, engine_dir, prompts, _ = tiny
    engine = load_engine(engine_dir, device="cuda", compile="cudagraphs", kernels=kernels)
    params = [SamplingConfig(max_tokens=24, temperature=0.9, top_k=40, top_p=0.95, seed=s) for s in range(len(prompts))]
    ar = [r.output_ids for r in generate(engine, prompts, params, "ar")]
    rd = [r.output_ids for r in generate(engine, prompts, params, "redrafter")]
    assert rd == ar
