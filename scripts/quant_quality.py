"""What quantization (weight-only, FP8) costs in quality: perplexity on held-out text and greedy agreement with the
float model, for this project's quantized engines and llama.cpp's quantized files, on the same token ids.

    python3 scripts/quant_quality.py --hf-model out/smollm2/hf --engines out/perf/engine-int8_wo,out/perf/engine-int4_awq \
        [--llama-cpp GGUF --llama-cpp-types f32,q8_0,q4_1] [--json out/quant/quality.json]

- The held-out text is every MT-Bench question (both turns, 160 texts; the evaluation set, which never enters a
  drafter's training), tokenized as plain text, scored in windows of `--window` tokens (each token's NLL given the
  window before it).
- An engine's quantized model is read the way the engine reads it (`Engine.load(..., linear="torch")`: each layer holds
  q * s in float), put into the Hugging Face model in place of its float weights, and scored and decoded there; so
  every row is one computation (HF's), and only the weights differ.
- Greedy agreement: MT-Bench first turns in the chat template, `--max-tokens` greedy tokens, against the float
  HF model's tokens: how many outputs are identical, and the mean fraction of tokens before the first difference.
- llama.cpp (llama-cpp-python): the same token ids, its logits for perplexity, its greedy tokens for agreement;
  the weight types are re-typed from `--llama-cpp` by llama.cpp's own quantizer (bench-engine's cache,
  trt_redrafter/bench/baselines.py).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from trt_redrafter.bench.baselines import llama_cpp_file
from trt_redrafter.chat import chat_prompt_ids
from trt_redrafter.config import RuntimeConfig
from trt_redrafter.datasets import mt_bench_path, read_jsonl
from trt_redrafter.model.linear import fp8_qdq
from trt_redrafter.model.tp import Dist
from trt_redrafter.runtime.engine import Engine


def mt_bench_texts() -> tuple[list[str], list[str]]:
    """(every turn of every question, the first turns)."""
    rows = [r for _, r in read_jsonl(mt_bench_path(), "MT-Bench")]
    return [t for r in rows for t in r["turns"]], [r["turns"][0] for r in rows]


def quantized_state(engine_dir: str, hf_model) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The engine's quantized base as HF-named float weights (TP 1): q * s from its layers, AWQ's input scale folded
    into the weight's columns; and, for FP8 layers, the e4m3 scale of each HF module's input."""
    engine = Engine.load(engine_dir, Dist(0, 1, torch.device("cpu")),
                    RuntimeConfig(linear="torch", compile="off", speculate="full"), warmup=False)
    model, cfg = engine.model, hf_model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    nq, nkv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d

    def w(layer) -> torch.Tensor:
        out = layer.weight.detach().float()
        return out * layer.pre_scale.float() if layer.pre_scale is not None else out

    state, input_scales = {}, {}
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        q, k, v = w(layer.attn.qkv).split([nq, nkv, nkv])
        gate, up = w(layer.mlp.fc_gate).chunk(2)
        state.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                      p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": w(layer.attn.dense),
                      p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                      p + "mlp.down_proj.weight": w(layer.mlp.proj)})
        for lin, hf_names in ((layer.attn.qkv, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                              (layer.attn.dense, ("self_attn.o_proj",)),
                              (layer.mlp.fc_gate, ("mlp.gate_proj", "mlp.up_proj")),
                              (layer.mlp.proj, ("mlp.down_proj",))):
            if lin.input_scale is not None:
                input_scales.update({p + n: lin.input_scale for n in hf_names})
    state["lm_head.weight"] = w(model.lm_head)[:cfg.vocab_size]
    if model.lm_head.input_scale is not None:
        input_scales["lm_head"] = model.lm_head.input_scale
    return state, input_scales


def load_into(hf_model, state: dict[str, torch.Tensor], input_scales: dict[str, torch.Tensor]):
    """A copy of the float HF model with `state` in place of its weights (lm_head untied from the embedding), and
    FP8's input quantize-dequantize (`fp8_qdq`, as the engine applies it) before the modules of `input_scales`."""
    import copy

    m = copy.deepcopy(hf_model)
    m.lm_head.weight = torch.nn.Parameter(m.lm_head.weight.detach().clone(), requires_grad=False)
    params = dict(m.named_parameters())
    for name, t in state.items():
        params[name].data.copy_(t)
    for name, scale in input_scales.items():
        m.get_submodule(name).register_forward_pre_hook(lambda _m, args, s=scale: (fp8_qdq(args[0], s),))
    return m


def perplexity_hf(model, docs: list[list[int]], window: int) -> float:
    nll, n = 0.0, 0
    with torch.inference_mode():
        for ids in docs:
            for s in range(0, len(ids) - 1, window):
                chunk = torch.tensor([ids[s:s + window + 1]])
                logits = model(chunk[:, :-1]).logits.float()
                nll += torch.nn.functional.cross_entropy(logits[0], chunk[0, 1:], reduction="sum").item()
                n += chunk.shape[1] - 1
    return math.exp(nll / n)


def greedy_hf(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False,
                               min_new_tokens=max_tokens)
            outs.append(y[0, len(ids):].tolist())
    return outs


def agreement(outs: list[list[int]], ref: list[list[int]]) -> dict:
    prefix = []
    for a, b in zip(outs, ref):
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(k / max(len(b), 1))
    return {"identical": f"{sum(a == b for a, b in zip(outs, ref))}/{len(ref)}",
            "mean_prefix_fraction": round(sum(prefix) / len(prefix), 3)}


def llama_cpp_rows(gguf: Path, kinds: list[str], docs, prompts, max_tokens, window, threads, ref) -> dict:
    import numpy as np
    from llama_cpp import Llama

    rows = {}
    for kind in kinds:
        llm = Llama(model_path=str(llama_cpp_file(gguf, kind, threads)), n_ctx=window + max_tokens + 1024,
                    n_threads=threads, n_threads_batch=threads, n_batch=512, logits_all=True, verbose=False)
        nll, n = 0.0, 0
        for ids in docs:
            for s in range(0, len(ids) - 1, window):
                chunk = ids[s:s + window + 1]
                llm.reset()
                llm.eval(chunk[:-1])
                logits = np.asarray(llm.scores[:len(chunk) - 1], dtype=np.float64)
                logz = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
                nll += float((logz - logits[np.arange(len(chunk) - 1), chunk[1:]]).sum())
                n += len(chunk) - 1
        outs = []
        for ids in prompts:
            toks = []
            for t in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
                toks.append(t)
                if len(toks) == max_tokens:
                    break
            outs.append(toks)
        rows[f"llama.cpp {kind}"] = {"perplexity": round(math.exp(nll / n), 3), **agreement(outs, ref)}
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf-model", required=True, help="the float base's Hugging Face directory")
    ap.add_argument("--engines", default="", help="comma-separated quantized engine directories (TP 1)")
    ap.add_argument("--llama-cpp", type=Path, metavar="GGUF", help="the base as GGUF: also score llama.cpp")
    ap.add_argument("--llama-cpp-types", default="f32,q8_0,q4_1")
    ap.add_argument("--num-prompts", type=int, default=8, help="MT-Bench first turns for greedy agreement")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.hf_model)
    base = AutoModelForCausalLM.from_pretrained(args.hf_model, dtype=torch.float32).eval()
    base.generation_config.eos_token_id = None
    texts, firsts = mt_bench_texts()
    docs = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    prompts = [chat_prompt_ids(tok, f) for f in firsts[:args.num_prompts]]
    ref = greedy_hf(base, prompts, args.max_tokens)
    rows = {"float32 (HF)": {"perplexity": round(perplexity_hf(base, docs, args.window), 3),
                             **agreement(ref, ref)}}
    for engine_dir in filter(None, args.engines.split(",")):
        model = load_into(base, *quantized_state(engine_dir, base))
        rows[Path(engine_dir).name] = {"perplexity": round(perplexity_hf(model, docs, args.window), 3),
                                       **agreement(greedy_hf(model, prompts, args.max_tokens), ref)}
        del model
    if args.llama_cpp:
        kinds = [k.strip() for k in args.llama_cpp_types.split(",") if k.strip()]
        rows.update(llama_cpp_rows(args.llama_cpp, kinds, docs, prompts, args.max_tokens, args.window, args.threads,
                                   ref))
    n_tok = sum(map(len, docs))
    print(f"held-out text: {len(docs)} MT-Bench turns, {n_tok} tokens, windows of {args.window}; greedy agreement: "
          f"{len(prompts)} first turns (chat template) x {args.max_tokens} tokens vs the float model")
    print("| model | perplexity | greedy outputs identical | mean agreeing prefix |\n|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['perplexity']:.3f} | {r['identical']} | {r['mean_prefix_fraction']:.2f} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"tokens": n_tok, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
