"""CUDA: the torch backend gives the same greedy tokens on the GPU as on the CPU (and as HF `generate`)."""

from __future__ import annotations

import pytest
import torch

from engine_utils import build_tiny_engines, greedy, hf_greedy, random_prompts
from trt_redrafter.runtime.distributed import Dist
from trt_redrafter.runtime.engine import Engine
from trt_redrafter.runtime.generate import generate

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("mode", ["ar", "redrafter"])
def test_cuda_greedy_matches_cpu_and_hf(tmp_path, mode):
    base, engines = build_tiny_engines(tmp_path, seed=2, num_beams=6, draft_len=4, num_heads=4, num_kv_heads=2)
    prompts = random_prompts(384, [5, 12, 3], seed=1)
    cpu = generate(Engine(engines[1], Dist(0, 1, torch.device("cpu"))), prompts, greedy(24), mode)
    gpu_engine = Engine(engines[1], Dist(0, 1, torch.device("cuda")))
    gpu = generate(gpu_engine, prompts, greedy(24), mode)
    assert [r.output_ids for r in gpu] == [r.output_ids for r in cpu]
    assert [r.output_ids for r in gpu] == [hf_greedy(base, p, 24) for p in prompts]
    assert gpu_engine.cache.used_blocks == 0
