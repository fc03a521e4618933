"""Dynamic NTK RoPE (HF `rope_type: dynamic`) past the trained context, against Hugging Face (fp32, CPU).

HF recomputes the frequencies at every forward for seq_len = max(position) + 1, and cached K/V keep the rotation
they were computed with: in one `generate` call the prompt (one forward of L tokens) rotates with freq(max(L, orig))
and each generated token at position p with freq(max(p + 1, orig)) (rope.py). So: greedy AR == HF `generate` (tokens
and logits) for prompts shorter than, equal to and longer than orig, batched together; ReDrafter == AR; a preempted
request recomputes the same rotations; and the runtime's cos/sin equal `LlamaRotaryEmbedding`'s outputs.

A random tiny model's argmax can be insensitive to RoPE details, so each parity check comes with its counter-check:
without the dynamic update (plain frequencies), or without the prompt rows, the logits move far beyond tolerance.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # the Triton kernels' test runs them under the interpreter (set before they load)
    os.environ["TRITON_INTERPRET"] = "1"

from engine_utils import OracleProposer, greedy, load_engine, random_prompts, run_cli
from trt_redrafter.checkpoint.hf import model_config_from_hf
from trt_redrafter.checkpoint.tiny import TinyConfig, make_tiny
from trt_redrafter.fsutil import read_json, write_json
from trt_redrafter.rope import RotaryEmbedding
from trt_redrafter.checkpoint.engine_config import load_engine_config
from trt_redrafter.runtime.generate import generate
from trt_redrafter.runtime.sequence import RequestSpec

ORIG = 32  # max_position_embeddings: the trained context
FACTOR = 2.0
THETA = 10000.0
END = 3 * ORIG  # every request generates up to position END - 1
PROMPT_LENS = {"short": 9, "orig": ORIG, "long": 44}  # L < orig, L == orig, L > orig (one batched prefill)
TOL = dict(rtol=1e-4, atol=1e-4)  # fp32 logits; HF computes its frequencies in fp32, the runtime in fp64
FAR = 1e-2  # what a wrong rotation must move the logits by at least, for the parity checks to mean something


def _max_new(prompt: list[int]) -> int:
    return END - len(prompt)


@pytest.fixture(scope="module")
def dyn(tmp_path_factory):
    """A tiny Llama with dynamic scaling (orig = 32) converted and built; its prompts and HF's greedy outputs."""
    root = tmp_path_factory.mktemp("rope-dynamic")
    make_tiny(root / "tiny", TinyConfig(seed=3, max_position_embeddings=ORIG))
    base = root / "tiny" / "base"
    cfg = read_json(base / "config.json", "tiny config")
    cfg["rope_parameters"] = {"rope_type": "dynamic", "factor": FACTOR, "rope_theta": THETA}
    write_json(base / "config.json", cfg)
    ckpt, eng = root / "ckpt", root / "engine"
    run_cli("convert", "--base-model", base, "--drafter", root / "tiny" / "drafter", "--output", ckpt,
            "--dtype", "float32", "--num-beams", 3, "--draft-len-per-beam", 3)
    run_cli("build-engine", "--checkpoint", ckpt, "--output", eng, "--backend", "torch", "--max-batch-size", 4,
            "--max-input-len", 64, "--max-seq-len", END + 8, "--kv-block-size", 16, "--model-ngrams", "off")
    vocab = cfg["vocab_size"]
    prompts = dict(zip(PROMPT_LENS, random_prompts(vocab, list(PROMPT_LENS.values()), seed=7)))
    hf, plain = _hf_model(base, dynamic=True), _hf_model(base, dynamic=False)
    return dict(base=base, engine_dir=eng, prompts=prompts,
                hf={k: _hf_generate(hf, p, _max_new(p)) for k, p in prompts.items()},
                plain={k: _hf_generate(plain, p, _max_new(p)) for k, p in prompts.items()})


def _hf_model(base, dynamic: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig.from_pretrained(base)
    if not dynamic:  # the same weights with the dynamic update turned off: what the runtime computed before
        cfg.rope_parameters = {"rope_type": "default", "rope_theta": THETA}
    model = LlamaForCausalLM.from_pretrained(base, config=cfg, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    assert model.model.rotary_emb.rope_type == ("dynamic" if dynamic else "default")
    return model


def _hf_generate(model, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """HF greedy -> (tokens [n], logits [n, V]). The rotary module's dynamic state is reset first: HF keeps the
    longest seq_len it has seen across calls, and a later prompt with orig < L < that length would reuse it."""
    rope = model.model.rotary_emb
    rope.register_buffer("inv_freq", rope.original_inv_freq.clone(), persistent=False)
    rope.max_seq_len_cached = rope.original_max_seq_len
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).float()


def _engine_ar(engine, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """The engine's greedy AR, one request, step by step -> (tokens [n], logits of every step [n, V])."""
    logits, orig = [], engine.model.logits

    def spy(hidden):
        out = orig(hidden)
        logits.append(out.reshape(-1, out.shape[-1])[-1].float().clone())
        return out

    s = engine.new_sequence(RequestSpec(prompt, greedy(n), mode="ar"))
    engine.model.logits = spy
    try:
        while not s.finished:
            engine.step([s])
    finally:
        engine.model.logits = orig
        engine.slots.release(s)
    return s.output, torch.stack(logits)


def _run(engine, prompts: dict, mode: str) -> dict[str, list[int]]:
    names = list(prompts)
    res = generate(engine, [prompts[k] for k in names], [greedy(_max_new(prompts[k])) for k in names], mode=mode)
    return {k: r.output_ids for k, r in zip(names, res)}


# ---- end to end ------------------------------------------------------------------------------------------------
def test_converter_carries_dynamic_scaling(dyn):
    scaling = load_engine_config(dyn["engine_dir"]).checkpoint.model.rotary_scaling
    assert (scaling["type"], scaling["factor"]) == ("dynamic", FACTOR)
    legacy = read_json(dyn["base"] / "config.json", "tiny config")  # transformers 4.x style: rope_scaling
    legacy.pop("rope_parameters")
    legacy["rope_scaling"] = {"rope_type": "dynamic", "factor": FACTOR}
    assert model_config_from_hf(legacy, "x").rotary_scaling == {"rope_type": "dynamic", "factor": FACTOR,
                                                                 "type": "dynamic"}


def test_hf_reference_is_sensitive_to_the_dynamic_update(dyn):
    """Plain frequencies give other logits (and tokens) than dynamic ones past orig, the same ones before it."""
    for k, prompt in dyn["prompts"].items():
        logits, logits_plain = dyn["hf"][k][1], dyn["plain"][k][1]  # [n, V] each
        L = len(prompt)  # step i's forward has seq_len L + i: the first past orig is the first with L + i > orig
        first_past = 0 if L > ORIG else ORIG - L + 1
        assert (logits[first_past:] - logits_plain[first_past:]).abs().max() > FAR, k
        if first_past:
            torch.testing.assert_close(logits[:first_past], logits_plain[:first_past], rtol=0, atol=1e-5)
    assert any(dyn["hf"][k][0] != dyn["plain"][k][0] for k in dyn["prompts"])


def test_batched_greedy_ar_equals_hf_generate(dyn):
    """Prompts shorter than, equal to and longer than orig, prefilled in one batch, each generating to 3 * orig."""
    out = _run(load_engine(dyn["engine_dir"]), dyn["prompts"], "ar")
    assert out == {k: v[0] for k, v in dyn["hf"].items()}


@pytest.mark.parametrize("name", sorted(PROMPT_LENS))
def test_ar_logits_equal_hf_at_every_step(dyn, name):
    tokens, logits = _engine_ar(load_engine(dyn["engine_dir"]), dyn["prompts"][name], _max_new(dyn["prompts"][name]))
    hf_tokens, hf_logits = dyn["hf"][name]
    assert tokens == hf_tokens
    torch.testing.assert_close(logits, hf_logits, **TOL)


def test_long_prompt_needs_its_prompt_rows(dyn):
    """Counter-check of the prompt rule: rotating a long prompt with the per-position table (as if each prompt token
    were generated) moves the first logits far from HF's."""
    engine = load_engine(dyn["engine_dir"])
    prompt = dyn["prompts"]["long"]
    _, logits = _engine_ar(engine, prompt, 1)
    torch.testing.assert_close(logits[0], dyn["hf"]["long"][1][0], **TOL)
    engine.model.rope.dynamic = False  # LlamaRank.rope_rows falls back to the table rows
    _, table_only = _engine_ar(engine, prompt, 1)
    assert (table_only[0] - dyn["hf"]["long"][1][0]).abs().max() > FAR


def test_greedy_redrafter_equals_ar_with_its_own_drafter(dyn):
    out = _run(load_engine(dyn["engine_dir"]), dyn["prompts"], "redrafter")
    assert out == {k: v[0] for k, v in dyn["hf"].items()}


@pytest.mark.parametrize("corrupt_every", [0, 2])
def test_greedy_redrafter_equals_ar_when_drafts_are_accepted(dyn, corrupt_every):
    """Oracle drafts: tree nodes at every depth are verified and accepted, across orig, as AR rotates them."""
    names = list(dyn["prompts"])
    ar = {i: dyn["hf"][k][0] for i, k in enumerate(names)}
    engine = load_engine(dyn["engine_dir"], OracleProposer(dyn["engine_dir"], ar, corrupt_every=corrupt_every))
    res = generate(engine, [dyn["prompts"][k] for k in names], [greedy(_max_new(dyn["prompts"][k])) for k in names],
                   mode="redrafter")
    assert [r.output_ids for r in res] == [ar[i] for i in range(len(names))]
    assert sum(r.accepted_draft_tokens for r in res) > 0


@pytest.mark.slow
@pytest.mark.timeout(900)  # inductor compiles the steps: minutes on 2 cores shared with another worker (CI's -n 2)
@pytest.mark.parametrize("runtime", [dict(compile="inductor"), dict(kernels="triton")], ids=["inductor", "triton"])
def test_compiled_step_and_kernels_equal_hf(dyn, runtime):
    """The compiled decode step and the Triton kernels (the interpreter, on the CPU) take the same rows."""
    names = ["short", "long"] if "kernels" in runtime else list(PROMPT_LENS)
    if "kernels" in runtime:
        pytest.importorskip("triton")
        n = {"short": ORIG - PROMPT_LENS["short"] + 4, "long": 6}  # the interpreter is slow: just past orig
    else:
        n = {k: _max_new(dyn["prompts"][k]) for k in names}
    engine = load_engine(dyn["engine_dir"], **runtime)
    for mode in ("ar", "redrafter"):
        res = generate(engine, [dyn["prompts"][k] for k in names], [greedy(n[k]) for k in names], mode=mode)
        # greedy output is a prefix of the longer reference: no rotation depends on how far a request goes
        assert [r.output_ids for r in res] == [dyn["hf"][k][0][:n[k]] for k in names], mode


def test_preempted_requests_recompute_the_same_rotations(dyn):
    """A preempted request prefills prompt + output again: the prompt rotates with freq(max(L, orig)) and its output
    tokens as the AR steps that made them did."""
    from trt_redrafter.runtime.scheduler import Request, Scheduler

    engine = load_engine(dyn["engine_dir"], kv_cache_tokens=10 * 16)  # room for about one and a half requests
    sched = Scheduler(engine)
    reqs = {k: sched.submit(Request(k, RequestSpec(p, greedy(_max_new(p)), mode="ar")))
            for k, p in dyn["prompts"].items()}
    sched.run_until_idle()
    assert sched.metrics().preemptions > 0
    assert {k: r.seq.output for k, r in reqs.items()} == {k: v[0] for k, v in dyn["hf"].items()}


# ---- the tables, unit check ----------------------------------------------------------------------------------
def _tiny_hf_config(**rope):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=ORIG,
                       rope_parameters={"rope_theta": THETA, **rope})


def _ours(hf_cfg) -> RotaryEmbedding:
    """The runtime's RotaryEmbedding, from the HF config through the checkpoint reader (as LlamaRank builds it)."""
    m = model_config_from_hf(hf_cfg.to_dict(), "hf")
    return RotaryEmbedding(m.head_size, m.rotary_base, m.rotary_scaling, m.max_position_embeddings, END + 1)


@pytest.mark.parametrize("L", [9, ORIG, 44])
def test_cos_sin_equal_hf_rotary_embedding(L):
    """One HF generate's forwards (a prompt of L tokens, then one token per step) vs the rows the runtime uses: the
    prompt step's `prompt_rows`, the decode steps' table rows."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = _tiny_hf_config(rope_type="dynamic", factor=FACTOR)
    hf, ours = LlamaRotaryEmbedding(cfg), _ours(cfg)
    x = torch.zeros(1, dtype=torch.float32)
    tol = dict(rtol=0, atol=2e-5)  # fp32 vs fp64 angles up to ~END radians

    pos = torch.arange(L)[None]  # [1, L]
    cos, sin = hf(x, pos)  # [1, L, D]
    rows = ours.prompt_rows(pos, torch.tensor([L]))
    torch.testing.assert_close(rows[0], cos[0], **tol)
    torch.testing.assert_close(rows[1], sin[0], **tol)
    for p in range(L, END):  # decode: one token per forward
        cos, sin = hf(x, torch.tensor([[p]]))
        torch.testing.assert_close(ours.cos[p], cos[0, 0], **tol)
        torch.testing.assert_close(ours.sin[p], sin[0, 0], **tol)
    if L <= ORIG:  # a prompt within orig rotates with the table rows themselves
        assert torch.equal(rows[0], ours.cos[:L]) and torch.equal(rows[1], ours.sin[:L])
    else:  # and the table rows alone would rotate a longer one differently
        assert (rows[0] - ours.cos[:L]).abs().max() > FAR


def test_prompt_rows_of_a_batch_and_of_a_recomputation():
    """Batched prefill rows: each request's own prompt length; past it (a preempted request's output, and padding)
    the table rows, bit for bit."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = _tiny_hf_config(rope_type="dynamic", factor=FACTOR)
    ours = _ours(cfg)
    T, lens = 60, [9, 44, 40]  # request 2: a 40-token prompt recomputed with 20 output tokens
    pos = torch.arange(T)[None].expand(3, T)
    cos, sin = ours.prompt_rows(pos, torch.tensor(lens))
    cos, sin = cos.view(3, T, -1), sin.view(3, T, -1)
    x = torch.zeros(1)
    for b, L in enumerate(lens):
        hf_cos, hf_sin = LlamaRotaryEmbedding(cfg)(x, torch.arange(L)[None])  # that request's own prompt forward
        torch.testing.assert_close(cos[b, :L], hf_cos[0], rtol=0, atol=2e-5)
        torch.testing.assert_close(sin[b, :L], hf_sin[0], rtol=0, atol=2e-5)
        assert torch.equal(cos[b, L:], ours.cos[L:T]) and torch.equal(sin[b, L:], ours.sin[L:T])


@pytest.mark.parametrize("rope", [{"rope_type": "default"}, {"rope_type": "linear", "factor": 2.0},
                                  {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 16}])
def test_static_scalings_have_no_prompt_rows_and_match_hf(rope):
    """Only dynamic scaling depends on the sequence length: the others use the table alone, HF's at any shape."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = _tiny_hf_config(**rope)
    ours = _ours(cfg)
    pos = torch.arange(END)[None]
    assert ours.prompt_rows(pos, torch.tensor([END])) is None
    cos, sin = LlamaRotaryEmbedding(cfg)(torch.zeros(1), pos)
    torch.testing.assert_close(ours.cos[:END], cos[0], rtol=0, atol=2e-5)
    torch.testing.assert_close(ours.sin[:END], sin[0], rtol=0, atol=2e-5)
