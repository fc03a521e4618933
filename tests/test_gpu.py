"""CUDA: the torch backend gives the same greedy tokens on the GPU as on the CPU and as HF `generate`, eager and
under CUDA graphs; sampled ReDrafter equals sampled AR for the same seed; prefix reuse, chunked prefill,
log-probabilities and every `--draft-beams` count keep the tokens on the GPU; the Triton kernels agree with their
PyTorch oracles at realistic shapes (tests/test_plugins.py runs them on CPU under the interpreter)."""

from __future__ import annotations

import pytest
import torch

from engine_utils import (OracleProposer, build_tiny_engines, check_logprobs_against_hf, chunk_calls, greedy,
                          hf_greedy, load_engine, random_prompts)
from trt_redrafter.config import SamplingConfig
from trt_redrafter.runtime import costs
from trt_redrafter.runtime.generate import generate
from trt_redrafter.runtime.sequence import RequestSpec

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
    res = generate(engine, prompts, greedy(24), mode)
    out = [r.output_ids for r in res]
    assert out == cpu_ar
    assert out == [hf_greedy(base, p, 24) for p in prompts]
    assert engine.cache.used_blocks == 0
    if mode == "redrafter":  # drafts made and some accepted (3 of 448 on the CPU: a random drafter)
        assert sum(r.draft_tokens for r in res) > 0 and sum(r.accepted_draft_tokens for r in res) > 0


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_cuda_sampled_redrafter_equals_sampled_ar(tiny, kernels):
    _, engine_dir, prompts, _ = tiny
    engine = load_engine(engine_dir, device="cuda", compile="cudagraphs", kernels=kernels)
    params = [SamplingConfig(max_tokens=24, temperature=0.9, top_k=40, top_p=0.95, seed=s) for s in range(len(prompts))]
    ar = [r.output_ids for r in generate(engine, prompts, params, "ar")]
    rd = [r.output_ids for r in generate(engine, prompts, params, "redrafter")]
    assert rd == ar


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 GEMMs (torch._scaled_mm) need compute capability 8.9 or later")
@pytest.mark.parametrize("compile", ["off", "cudagraphs"])
def test_cuda_fp8_base_runs_scaled_mm_and_greedy_redrafter_equals_fp8_ar(tmp_path, compile):
    """An FP8 base (`convert --quantize fp8`) on a GPU with FP8 GEMMs: its layers run torch._scaled_mm, greedy
    ReDrafter equals the FP8 model's greedy AR, and the GPU's FP8 model is the one the CPU emulates: one layer gives
    the CPU's product up to the FP8 tensor cores' accumulation (on an H200, 10 of 1792 outputs of a 128-input layer
    differed by up to 3e-4 of the largest: Hopper's FP8 MMA keeps fewer accumulator bits than fp32), and the whole
    model's logits lie far closer to the CPU's FP8 model than
    either lies to the float model (the models differ only where a different fp32 summation moves an input across
    an e4m3 rounding boundary in a later layer, which a whole-model tolerance cannot bound)."""
    import json
    from engine_utils import _hf_model
    calib = tmp_path / "calib.jsonl"
    calib.write_text("\n".join(json.dumps({"prompt": f"calibration prompt {i} of a few words"}) for i in range(8)))
    base, engines = build_tiny_engines(tmp_path, seed=2, num_beams=6, draft_len=4, hidden_size=128, num_heads=4,
                                       num_kv_heads=2, max_batch_size=4,
                                       convert_args=("--quantize", "fp8", "--calib-prompts", calib))
    prompts = random_prompts(384, PROMPT_LENS, seed=1)
    engine = load_engine(engines[1], device="cuda", compile=compile)
    layer = engine.model.layers[0]
    assert all(m.fp8 is not None for m in (layer.attn.qkv, layer.attn.dense, layer.mlp.fc_gate, layer.mlp.proj))
    ar = [r.output_ids for r in generate(engine, prompts, greedy(24), "ar")]
    rd = [r.output_ids for r in generate(engine, prompts, greedy(24), "redrafter")]
    assert rd == ar
    cpu = load_engine(engines[1])
    cpu_qkv = cpu.model.layers[0].attn.qkv
    assert cpu_qkv.fp8 is None and cpu_qkv.input_scale is not None
    x = torch.randn(7, cpu_qkv.in_features, generator=torch.Generator().manual_seed(0)) * float(
        cpu_qkv.input_scale) * 100
    y_cpu = cpu_qkv(x)
    torch.testing.assert_close(layer.attn.qkv(x.cuda()).cpu(), y_cpu, rtol=1e-3, atol=1e-3 * float(y_cpu.abs().max()))
    gpu_logits, cpu_logits = (_prompt_logits(e, prompts[1]) for e in (load_engine(engines[1], device="cuda"), cpu))
    with torch.no_grad():
        float_logits = _hf_model(str(base))(torch.tensor([prompts[1]])).logits[0, -cpu_logits.shape[0]:].float()
    quantization_error = (cpu_logits - float_logits).abs().max()
    assert (gpu_logits - cpu_logits).abs().max() < 0.25 * quantization_error, (
        float((gpu_logits - cpu_logits).abs().max()), float(quantization_error))


def _prompt_logits(engine, prompt: list[int]) -> torch.Tensor:
    """The logits of the prompt's tokens, from the engine's first step."""
    captured = {}
    orig = engine.model.logits

    def spy(hidden):
        out = orig(hidden)
        captured["logits"] = out.reshape(-1, out.shape[-1]).float().cpu().clone()
        return out

    engine.model.logits = spy
    engine.step([engine.new_sequence(RequestSpec(prompt, greedy(2)))])
    return captured["logits"]


@pytest.mark.parametrize("mode", ["int8_wo", "int4_awq"])
def test_cuda_weight_only_base_runs_the_triton_gemm_and_greedy_redrafter_equals_its_ar(tmp_path, mode):
    """A weight-only base on CUDA: its layers run the Triton weight-only GEMM (plugins/weight_only.py), greedy
    ReDrafter equals the quantized model's greedy AR, and the GPU's logits are the CPU kernel's (same model)."""
    pytest.importorskip("triton", reason="the weight-only GEMM needs triton")
    _, engines = build_tiny_engines(tmp_path, seed=2, num_beams=6, draft_len=4, hidden_size=128, num_heads=4,
                                    num_kv_heads=2, max_batch_size=4,
                                    convert_args=("--quantize", mode, "--group-size", "64", "--calib-prompts",
                                                  "none"))
    prompts = random_prompts(384, PROMPT_LENS, seed=1)
    engine = load_engine(engines[1], device="cuda")
    layer = engine.model.layers[0]
    assert all(m.quant is not None and m.packed.is_cuda
               for m in (layer.attn.qkv, layer.attn.dense, layer.mlp.fc_gate, layer.mlp.proj))
    ar = [r.output_ids for r in generate(engine, prompts, greedy(24), "ar")]
    assert [r.output_ids for r in generate(engine, prompts, greedy(24), "redrafter")] == ar
    gpu_logits, cpu_logits = (_prompt_logits(load_engine(engines[1], **kw), prompts[1])
                              for kw in ({"device": "cuda"}, {}))
    torch.testing.assert_close(gpu_logits, cpu_logits, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("compile", ["off", "cudagraphs"])
def test_cuda_int8_drafter_weights_run_the_triton_gemm_and_greedy_redrafter_equals_ar(tiny, compile):
    pytest.importorskip("triton", reason="the weight-only GEMM needs triton")
    _, engine_dir, prompts, cpu_ar = tiny
    engine = load_engine(engine_dir, device="cuda", compile=compile, drafter_weights="int8")
    head = engine.drafter.lm_head
    assert head.quant is not None and head.quant[1] == 8 and head.packed.is_cuda
    res = generate(engine, prompts, greedy(24), "redrafter")
    assert [r.output_ids for r in res] == cpu_ar
    assert sum(r.accepted_draft_tokens for r in res) > 0


def test_cuda_cost_model_is_measured_under_cuda_graphs(tiny):
    """The speculation policy's step costs are measured on the captured graphs (their static inputs are inference
    tensors, so the measurement must run in inference mode), and a tree step verifies more than an AR step."""
    _, engine_dir, _, _ = tiny
    engine = load_engine(engine_dir, device="cuda", compile="cudagraphs")
    model = costs.measure(engine.launcher, engine.dist, engine.slots.free, engine.build.max_seq_len, True)
    assert model.batches[0] == 1 and model.widths[0] == 1
    assert all(o["ar_ms"] > 0 and o["width1_ms"] > 0 for o in model.overheads())


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
@pytest.mark.parametrize("compile", ["off", "cudagraphs"])
def test_cuda_qwen_greedy_redrafter_equals_ar_equals_hf(tmp_path_factory, family, compile):
    """A Qwen base (q/k/v biases, or per-head q/k norms) on CUDA with the Triton kernels: greedy ReDrafter == AR ==
    the CPU engine == HF generate."""
    base, engines = build_tiny_engines(tmp_path_factory.mktemp(family), seed=5, num_beams=4, draft_len=3,
                                       hidden_size=128, num_heads=4, num_kv_heads=2, max_batch_size=4, family=family)
    prompts = random_prompts(384, PROMPT_LENS, seed=1)
    repeated = [(p * 4)[:16] for p in prompts]  # repeated text: the N-gram proposer's drafts are accepted
    hf = [hf_greedy(base, p, 24) for p in repeated]
    engine = load_engine(engines[1], device="cuda", compile=compile, kernels="triton")
    ar = [r.output_ids for r in generate(engine, repeated, greedy(24), "ar")]
    rd = generate(engine, repeated, greedy(24), "redrafter")
    ng = generate(engine, repeated, greedy(24), "redrafter", proposer="ngram")
    assert ar == hf and [r.output_ids for r in rd] == hf and [r.output_ids for r in ng] == hf
    assert sum(r.draft_tokens for r in rd) > 0 and sum(r.accepted_draft_tokens for r in ng) > 0


# ---- what an application needs, on the GPU: prefix reuse, chunked prefill, log-probabilities, fewer beams ----------

CHAT_VOCAB, CHAT_BLOCK = 512, 16
SYSTEM = random_prompts(CHAT_VOCAB, [37], seed=9)[0]  # a shared "system prompt": two full KV blocks and change
USERS = random_prompts(CHAT_VOCAB, [5, 9, 16, 3], seed=2)


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    base, engines = build_tiny_engines(tmp_path_factory.mktemp("gpu-chat"), seed=5, num_beams=4, draft_len=3,
                                       vocab_size=CHAT_VOCAB, max_seq_len=320, kv_block_size=CHAT_BLOCK,
                                       max_batch_size=4)
    return base, engines[1]


def _oracle(engine_dir, prompts, outputs):
    """Host trees that draft each prompt's known AR continuation (every other tree wrong at some depth)."""
    return OracleProposer(engine_dir, {tuple(p): o for p, o in zip(prompts, outputs)}, corrupt_every=2, key="prompt")


def check_reuse_and_chunks_keep_the_tokens(engine_dir, device: str, compile: str) -> None:
    """A conversation over one system prompt (one request, then three together, then a second turn over the first
    answer) with prefix reuse on and prompts prefilled in chunks of 32 tokens gives what a cold CPU engine gives
    without either: AR, ReDrafter with its own drafter, and ReDrafter drafting the known continuation (drafts
    accepted); later requests prefill over the cached system prompt."""
    cold = load_engine(engine_dir, kv_cache_reuse=False, enable_chunked_context=False)
    first_turn = [SYSTEM + u for u in USERS]
    want = [r.output_ids for r in generate(cold, first_turn, greedy(24), "ar")]
    second = SYSTEM + USERS[0] + want[0][:18] + [7, 8, 9]
    want.append(generate(cold, [second], greedy(24), "ar")[0].output_ids)
    prompts = first_turn + [second]
    for mode, proposer in (("ar", None), ("redrafter", None), ("redrafter", _oracle(engine_dir, prompts, want))):
        engine = load_engine(engine_dir, proposer, device=device, compile=compile, max_num_tokens=32)
        chunks = chunk_calls(engine)
        res = (generate(engine, prompts[:1], greedy(24), mode) + generate(engine, prompts[1:4], greedy(24), mode)
               + generate(engine, prompts[4:], greedy(24), mode))
        assert [r.output_ids for r in res] == want, (mode, proposer)
        assert [r.cached_tokens for r in res] == [0] + [2 * CHAT_BLOCK] * 3 + [3 * CHAT_BLOCK]
        assert chunks and max(chunks) <= 32  # the system prompt's first turn was prefilled in chunks
        assert engine.cache.used_blocks == 0
        if mode == "redrafter":
            assert sum(r.draft_tokens for r in res) > 0
            if proposer is not None:
                assert sum(r.accepted_draft_tokens for r in res) > 0


@pytest.mark.parametrize("compile", ["off", "cudagraphs"])
def test_cuda_prefix_reuse_and_chunked_prefill_keep_the_cpu_tokens(chat, compile):
    check_reuse_and_chunks_keep_the_tokens(chat[1], "cuda", compile)


def check_logprobs(base, engine_dir, device: str, compile: str) -> None:
    """Greedy log-probabilities (each token's and the top 3) equal HF's log_softmax on the CPU, and ReDrafter, with
    drafts accepted, reports what AR reports."""
    params = SamplingConfig(max_tokens=16, logprobs=True, top_logprobs=3)
    prompts = [SYSTEM + u for u in USERS[:3]]
    engine = load_engine(engine_dir, device=device, compile=compile)
    ar = generate(engine, prompts, params, "ar")
    rd = generate(load_engine(engine_dir, _oracle(engine_dir, prompts, [r.output_ids for r in ar]), device=device,
                              compile=compile), prompts, params, "redrafter")
    assert sum(r.accepted_draft_tokens for r in rd) > 0
    for p, a, r in zip(prompts, ar, rd):
        assert r.output_ids == a.output_ids
        for got in (a, r):
            check_logprobs_against_hf(base, p, got, top=3, atol=1e-3)


@pytest.mark.parametrize("compile", ["off", "cudagraphs"])
def test_cuda_logprobs_equal_hf_and_redrafter_reports_what_ar_reports(chat, compile):
    check_logprobs(chat[0], chat[1], "cuda", compile)


def check_every_beam_count(engine_dir, prompts, want, device: str) -> None:
    """`--draft-beams N` at every count an eager engine can draft (1, 2, 4, 6 of 6): greedy ReDrafter gives AR's
    tokens, with its own drafter's drafts made."""
    options = load_engine(engine_dir, device=device).launcher.beam_options
    assert options == [1, 2, 4, 6]
    for k in options:
        res = generate(load_engine(engine_dir, device=device, draft_beams=str(k)), prompts, greedy(24), "redrafter")
        assert [r.output_ids for r in res] == want, k
        assert sum(r.draft_tokens for r in res) > 0


def test_cuda_eager_draft_beams_give_ar_tokens_at_every_count(tiny):
    _, engine_dir, prompts, cpu_ar = tiny
    check_every_beam_count(engine_dir, prompts, cpu_ar, "cuda")
