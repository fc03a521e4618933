"""RuntimeConfig.drafter_dtype (`--drafter-dtype`) and drafter_weights (`--drafter-weights int8|w8a8|w4a8|auto`): the
drafter computes in its own dtype, from int8 weights if asked (w8a8: its inputs in int8 too; auto, the default: w8a8 on
a CPU with VNNI). It only proposes and the
model verifies every token, so greedy output stays the model's; on a float32 engine a bfloat16 drafter reads half
the bytes per drafted token, and its drafts (so tokens per step) stay close to the float32 drafter's. Sampled
output still follows the model's distribution: the acceptance rule uses the distribution the drafts came from."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine_utils import SMALL, build_small_engine, load_engine
from trt_redrafter.config import RuntimeConfig, SamplingConfig
from trt_redrafter.errors import UserError
from trt_redrafter.runtime.generate import generate

needs_small = pytest.mark.skipif(not (SMALL / "drafter" / "model.safetensors").is_file(),
                                 reason="models/small not trained")
PROMPTS = ["def dedent(text):\n    \"\"\"Remove any common leading whitespace from every line in `text`.\n",
           "class Fraction(numbers.Rational):\n", "def heappush(heap, item):\n"]


@pytest.fixture(scope="module")
def small_engine(tmp_path_factory) -> Path:
    return build_small_engine(tmp_path_factory.mktemp("drafter-dtype"), num_beams=4, draft_len=4, max_batch_size=32,
                              max_input_len=128, max_seq_len=256)


def _prompts() -> list[list[int]]:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(SMALL / "base"))
    return [tok(p)["input_ids"] for p in PROMPTS]


@needs_small
@pytest.mark.parametrize("linear", ["torch", "auto"])
def test_a_bfloat16_drafter_on_a_float32_engine_keeps_the_output_and_the_acceptance(small_engine, linear):
    fp32 = load_engine(small_engine, linear=linear, drafter_dtype="float32", drafter_weights="")
    bf16 = load_engine(small_engine, linear=linear, drafter_dtype="bfloat16", drafter_weights="")
    assert fp32.dtype == bf16.dtype == torch.float32 and fp32.drafter.dtype == torch.float32
    assert bf16.drafter.dtype == torch.bfloat16
    head = bf16.drafter.lm_head
    assert (head.weight if head.packed is None else head.packed).dtype == torch.bfloat16
    proj = bf16.model.layers[0].mlp.proj
    assert (proj.weight if proj.packed is None else proj.packed).dtype == torch.float32  # the model's own dtype
    params = SamplingConfig(max_tokens=48)
    ar = [r.output_ids for r in generate(fp32, _prompts(), params, mode="ar")]
    rd32 = generate(fp32, _prompts(), params, mode="redrafter")
    rd16 = generate(bf16, _prompts(), params, mode="redrafter")
    assert [r.output_ids for r in rd32] == ar and [r.output_ids for r in rd16] == ar
    tps32 = sum(r.tokens_per_step for r in rd32) / len(rd32)
    tps16 = sum(r.tokens_per_step for r in rd16) / len(rd16)
    assert tps32 > 1.5 and tps16 > 0.9 * tps32, (tps32, tps16)


@needs_small
@pytest.mark.slow
@pytest.mark.timeout(900)  # inductor compiles the steps: minutes on 2 cores shared with another worker (CI's -n 2)
def test_compiled_bfloat16_drafter_on_a_float32_engine_equals_ar(small_engine):
    """inductor over a step whose drafter runs in another dtype than the model (casts at its input and output)."""
    torch._dynamo.reset()
    eager = load_engine(small_engine)
    params = SamplingConfig(max_tokens=32)
    ar = [r.output_ids for r in generate(eager, _prompts(), params, mode="ar")]
    engine = load_engine(small_engine, compile="inductor", drafter_dtype="bfloat16")
    res = generate(engine, _prompts(), params, mode="redrafter")
    assert [r.output_ids for r in res] == ar
    assert sum(r.accepted_draft_tokens for r in res) > 0


@needs_small
def test_sampled_output_with_a_bfloat16_drafter_follows_the_ar_distribution(small_engine):
    from test_engine_sampling import N, _pvalue, _target

    prompt = [1, 321, 530, 265, 11]  # "def main(" in models/small's tokenizer
    probs, joint = _target(SMALL / "base", prompt)
    p, accepted = _pvalue(small_engine, probs, joint, proposer="redrafter", prompt=prompt, drafter_dtype="bfloat16")
    assert accepted > N // 4, accepted
    assert p > 1e-3, p


@needs_small
def test_the_default_drafter_dtype_is_bfloat16_where_the_cpu_computes_it(small_engine):
    from trt_redrafter import cpu

    engine = load_engine(small_engine)
    native = cpu.available(torch.bfloat16) and engine.linear == "avx512"
    assert engine.drafter.dtype == (torch.bfloat16 if native else torch.float32)
    assert load_engine(small_engine, linear="torch").drafter.dtype == torch.float32  # no native bf16 GEMM there


@needs_small
@pytest.mark.parametrize("weights", ["int8", "w8a8", "w4a8"])
@pytest.mark.parametrize("linear", ["torch", "auto"])
def test_int8_drafter_weights_keep_the_output_and_the_acceptance(small_engine, linear, weights):
    """int8 weights, one scale per output channel: each drafter layer reads int8 (the avx512 kernel's weight-only
    path; with w8a8 on a VNNI CPU its input in int8 too, multiplied in bytes; or its dequantized weight under
    torch), greedy output is still AR's, and the drafts stay about as good."""
    from trt_redrafter import cpu

    plain = load_engine(small_engine, linear=linear, drafter_weights="")
    int8 = load_engine(small_engine, linear=linear, drafter_weights=weights)
    assert int8.drafter.weights == weights and int8.drafter.dtype == plain.drafter.dtype
    layers = [int8.drafter.lm_head, *int8.drafter.layers, *int8.drafter.rnn]
    head_bits = 4 if weights == "w4a8" else 8  # w4a8: the head in int4, the other layers in int8
    if int8.drafter.linear == "avx512" and weights != "int8" and cpu.vnni_available():
        assert all(m.w8a8 is not None and "int8 activations" in m.path for m in layers)
        assert [m.w8a8[3] for m in layers] == [head_bits] + [8] * (len(layers) - 1)
    elif int8.drafter.linear == "avx512":
        assert [m.quant[1] for m in layers] == [head_bits] + [8] * (len(layers) - 1)
    else:  # under F.linear or oneDNN the layer computes its dequantized weight: the same quantized drafter
        x = torch.randn(4, layers[0].in_features, generator=torch.Generator().manual_seed(0)).to(int8.drafter.dtype)
        y, ref = layers[0](x).float(), plain.drafter.lm_head(x).float()
        # each weight within tol of the float one (int4: +amax clamps to 7 / 8 of it), so each output within tol * |x|_1
        tol = _amax(plain.drafter.lm_head) * (0.01 if head_bits == 8 else 0.13)
        assert not torch.equal(y, ref) and bool(((y - ref).abs() <= tol * x.float().abs().sum(1, keepdim=True)).all())
    params = SamplingConfig(max_tokens=48)
    ar = [r.output_ids for r in generate(plain, _prompts(), params, mode="ar")]
    rd = generate(plain, _prompts(), params, mode="redrafter")
    rd8 = generate(int8, _prompts(), params, mode="redrafter")
    assert [r.output_ids for r in rd8] == ar
    tps = sum(r.tokens_per_step for r in rd) / len(rd)
    tps8 = sum(r.tokens_per_step for r in rd8) / len(rd8)
    assert tps > 1.5 and tps8 > 0.9 * tps, (tps, tps8)


@needs_small
@pytest.mark.parametrize("weights", ["", "int8", "w8a8"])
def test_the_first_depth_adds_rnn_u_s_bias_instead_of_reading_it(small_engine, weights):
    """Beam search starts from Apple's zero state, where rnn_u(s) is rnn_u's bias: depth 0 adds the bias without
    reading rnn_u's weights, the same sum bit for bit (also from int8 weights and inputs: a zero row's product is
    zero)."""
    d = load_engine(small_engine, drafter_weights=weights).drafter
    # the avx512 kernels read the int8 bytes; oneDNN and F.linear compute the dequantized weight
    assert weights == "" or d.linear != "avx512" or all(m.quant is not None or m.w8a8 is not None for m in d.rnn)
    g = torch.Generator().manual_seed(0)
    emb, s = (torch.randn(5, d.cfg.hidden_size, generator=g).to(d.dtype) for _ in range(2))
    w, u = d.rnn
    zero = d.init_state(5)
    assert torch.equal(d.update_state(emb, zero, 0), F.silu(d._col(emb, w) + d._col(zero, u)))
    assert torch.equal(d.update_state(emb, s, 1), F.silu(d._col(emb, w) + d._col(s, u)))  # later depths read it


@needs_small
def test_the_default_drafter_weights_are_w8a8_where_the_cpu_multiplies_bytes(small_engine):
    """auto: w8a8 where the drafter runs the AVX-512 kernels on a VNNI CPU, else its weights as stored."""
    from trt_redrafter import cpu

    engine = load_engine(small_engine)
    vnni = engine.drafter.linear == "avx512" and cpu.vnni_available()
    assert engine.drafter.weights == ("w8a8" if vnni else "")
    assert ("avx512 int8 weights, int8 activations (VNNI)" in lin_paths(engine)) == vnni
    torch_engine = load_engine(small_engine, linear="torch")
    assert torch_engine.drafter.weights == "" and torch_engine.drafter.lm_head.weight is not None


def _amax(layer) -> float:
    """max |W| of a linear layer, whichever kernel holds its weight (oneDNN keeps it packed): its outputs for the
    unit rows, less the bias."""
    eye = torch.eye(layer.in_features, dtype=torch.float32)
    dtype = layer.weight.dtype if layer.weight is not None else layer.packed.dtype
    return float((layer(eye.to(dtype)) - layer(eye[:1].to(dtype) * 0)).abs().max())


def lin_paths(engine) -> dict[str, int]:
    from trt_redrafter.model.linear import linear_paths
    return linear_paths(engine.drafter)


def test_refusal():
    with pytest.raises(UserError, match="drafter_dtype"):
        RuntimeConfig(drafter_dtype="int8").validate()
    with pytest.raises(UserError, match="drafter_weights"):
        RuntimeConfig(drafter_weights="int4").validate()
