#!/usr/bin/env python3
"""The GPU benchmark in one command: a random Vicuna-7B-shaped model + Apple-recipe drafter built in place (bf16),
AR vs ReDrafter at several batch sizes on this project's engine, Hugging Face `generate` on the same weights, and
the HBM roofline from this card's measured copy bandwidth. Prints a markdown table; the last stdout line is one
JSON document (also written to --output).

    python scripts/gpu_bench.py                      # 7B shape, nb 6 / beam length 5, batch 1, 8, 32
    python scripts/gpu_bench.py --shape tiny --device cpu --batches 1,2 --compile off   # a dry run anywhere

Random weights make the drafter's guesses wrong, so measured tokens/step is ~1. Every step has a static shape (the
tree is padded to 1 + nb*dl tokens, CUDA graphs replay the same kernels), so the *step* time does not depend on
acceptance; `projected ms/token` divides it by the tokens/step of a trained drafter (--assumed-tokens-per-step,
default 3.5: Apple's reported acceptance for Vicuna-7B) and is labelled as a projection. The engine verifies every
tree whole (`speculate full`): the speculation policy would rightly take AR steps for a random drafter, and this
measures what a tree step costs.

Roofline: an AR step must read every base weight once plus each request's KV cache; floor = bytes / measured copy
bandwidth (bytes read + written by a large device-to-device copy, per METHOD.md). A ReDrafter step must also read
the drafter once per drafted token (dl times), which is its own floor.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout without installing

from trt_redrafter.checkpoint.sharding import Mapping, shard_base, shard_drafter  # noqa: E402
from trt_redrafter.checkpoint.tiny import TinyConfig, build_drafter_tensors  # noqa: E402
from trt_redrafter.checkpoint.trtllm_config import build_pretrained_config, parse_checkpoint_config  # noqa: E402
from trt_redrafter.config import (BuildConfig, DrafterConfig, ModelConfig, ProposerConfig, ReDrafterConfig,  # noqa: E402
                                  RuntimeConfig, SamplingConfig)
from trt_redrafter.model.tp import Dist  # noqa: E402
from trt_redrafter.runtime.engine import Engine  # noqa: E402
from trt_redrafter.checkpoint.engine_config import EngineConfig  # noqa: E402
from trt_redrafter.bench.baselines import hf_generate  # noqa: E402
from trt_redrafter.bench.measure import phase_profile, run_mode  # noqa: E402
from trt_redrafter.bench.oracle import ContinuationOracle  # noqa: E402
from trt_redrafter.runtime.generate import generate  # noqa: E402

SHAPES = {
    # name: (ModelConfig kwargs, drafter exit_dim, drafter layers)
    "vicuna-7b": (dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=2048), 8192, 2),
    "tiny": (dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512), 128, 1),
}


@dataclass
class Pair:
    cfg: EngineConfig
    tensors: dict[str, torch.Tensor]
    hf: torch.nn.Module
    base_bytes: int
    drafter_bytes: int


def random_pair(shape: str, nb: int, dl: int, max_batch: int, max_input: int, max_seq: int, device: torch.device,
                dtype: torch.dtype, seed: int, successor: bool = False, draft_vocab: int = 0) -> Pair:
    """HF LlamaForCausalLM with HF's random init + an Apple-format drafter (fan-in scaled), both on `device`;
    the engine's tensors are the checkpoint layout of the same weights (shared storage where the layout agrees).
    `draft_vocab` K > 0: the drafter's head scores only token ids 0..K-1 (a draft vocabulary, model/drafter.py)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    mkw, exit_dim, layers = SHAPES[shape]
    dname = str(dtype).removeprefix("torch.")
    model = ModelConfig(**mkw, dtype=dname)
    drafter = DrafterConfig(vocab_size=model.vocab_size, hidden_size=model.hidden_size, exit_dim=exit_dim,
                            num_draft_layers=layers, rnn=True, draft_vocab_size=draft_vocab)
    torch.manual_seed(seed)
    hf_cfg = LlamaConfig(vocab_size=model.vocab_size, hidden_size=model.hidden_size,
                         intermediate_size=model.intermediate_size, num_hidden_layers=model.num_hidden_layers,
                         num_attention_heads=model.num_attention_heads, num_key_value_heads=model.num_key_value_heads,
                         max_position_embeddings=model.max_position_embeddings, rms_norm_eps=model.norm_epsilon,
                         tie_word_embeddings=False)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            hf = LlamaForCausalLM(hf_cfg).eval()
    finally:
        torch.set_default_dtype(default)
    sd = dict(hf.state_dict())
    if successor:
        make_successor(sd, seed)
    m = Mapping(1, 0)
    tensors = shard_base(sd.__getitem__, model, m, lambda t: t.to(dtype))
    # the Apple-format drafter with make-tiny's random init (fan-in scaled), at this shape
    apple = {k: t.to(device=device, dtype=dtype) for k, t in build_drafter_tensors(TinyConfig(
        seed=seed, vocab_size=model.vocab_size, hidden_size=model.hidden_size, exit_dim=exit_dim,
        drafter_layers=layers, rnn=True)).items()}
    if draft_vocab:
        head = f"lm_head.{layers}.weight"
        apple[head] = apple[head][:draft_vocab].contiguous()
        apple["draft_vocab"] = torch.arange(draft_vocab)
    tensors.update(shard_drafter(apple, drafter, m, lambda t: t))
    rd = ReDrafterConfig(num_beams=nb, draft_len_per_beam=dl)
    info = parse_checkpoint_config(build_pretrained_config(model, drafter, rd, 1), where="gpu_bench")
    build = BuildConfig(max_batch_size=max_batch, max_input_len=max_input, max_seq_len=max_seq, dtype=dname)
    cfg = EngineConfig(info, build, "torch", "gpu_bench", {}, rd, ProposerConfig().resolved(True, nb))
    base_bytes = sum(t.numel() * t.element_size() for t in sd.values())
    drafter_bytes = sum(t.numel() * t.element_size() for k, t in apple.items() if k != "draft_vocab")
    return Pair(cfg, tensors, hf, base_bytes, drafter_bytes)


def quantized(pair: Pair, mode: str, calib_ids: list[list[int]], group_size: int = 128) -> tuple[EngineConfig, dict]:
    """The same pair with its base in one of `convert --quantize`'s forms (checkpoint/quantization.py): the config
    says so and, for FP8, the layers are stored as the checkpoint would hold them, with their input scales calibrated
    by the HF model on `calib_ids`; weight-only modes are quantized by the engine at load, as from a checkpoint."""
    if mode == "none":
        return pair.cfg, pair.tensors
    from trt_redrafter.checkpoint.calibration import fp8_amax
    from trt_redrafter.checkpoint.quantization import store_quantized

    cfg0 = pair.cfg
    m = cfg0.checkpoint.model
    raw = build_pretrained_config(m, cfg0.checkpoint.drafter, cfg0.tree, 1, quantize=mode, group_size=group_size)
    info = parse_checkpoint_config(raw, where=f"gpu_bench --quantize {mode}")
    quant = info.quant
    tensors = pair.tensors
    if quant.stored_quantized:
        if not quant.fp8:
            raise SystemExit(f"--quantize {mode}: needs AWQ's calibration search; use int4_wo, int8_wo or fp8 here")
        calib = fp8_amax(pair.hf, calib_ids, m.num_hidden_layers, lm_head=False)
        tensors = store_quantized(tensors, quant, m.num_hidden_layers, getattr(torch, m.dtype), calib)
    return dataclasses.replace(cfg0, checkpoint=info), tensors


def quantized_base_bytes(pair: Pair, cfg: EngineConfig) -> int:
    """The bytes an AR step reads of the base as `cfg` quantizes it: the transformer layers' linear weights at the
    quantization's width (8 bits for FP8; scales are a rounding error), everything else as stored."""
    quant = cfg.checkpoint.quant
    if quant is None:
        return pair.base_bytes
    bits = 8 if quant.fp8 else quant.bits
    linear = sum(t.numel() * t.element_size() for k, t in pair.tensors.items()
                 if k.startswith("transformer.layers.") and k.endswith(".weight") and t.dim() == 2)
    return pair.base_bytes - linear + linear * bits // (8 * pair.tensors["transformer.ln_f.weight"].element_size())


def make_successor(sd: dict[str, torch.Tensor], seed: int) -> None:
    """Random weights whose greedy choice is unmistakable: the attention and MLP outputs scaled by 1e-5 (the residual
    stream stays the current token's embedding) and lm_head row perm[u] = embedding u, so the next token is perm(current)
    by a margin of ~|e|^2 against random dot products. A random model's top-2 logits are near-ties that bf16 rounding
    flips (a 25-token verify and a 1-token AR step round differently), which would make the oracle's known
    continuation wrong after the first flip; with this one, greedy ReDrafter == AR holds and the oracle's rate is the
    acceptance. Step times do not depend on weight values (dense GEMMs of the same shapes)."""
    with torch.no_grad():
        for k, t in sd.items():
            if k.endswith(("o_proj.weight", "down_proj.weight")):
                t.mul_(1e-5)
        emb = sd["model.embed_tokens.weight"]
        perm = torch.randperm(emb.shape[0], generator=torch.Generator().manual_seed(seed)).to(emb.device)
        sd["lm_head.weight"].index_copy_(0, perm, emb)


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Bytes read + written per second by a large device-to-device copy (median of 20)."""
    if device.type != "cuda":
        return float("nan")
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    b = torch.empty_like(a)
    times = []
    for _ in range(25):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    return 2 * nbytes / statistics.median(times[5:])


def prompts_for(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(batch)]


def measure(engine: Engine, prompts: list[list[int]], max_tokens: int, mode: str, repeats: int) -> dict:
    params = SamplingConfig(max_tokens=max_tokens)
    run_mode(engine, prompts, params, mode)  # warm-up (first captures for this batch bucket)
    runs = [run_mode(engine, prompts, params, mode) for _ in range(repeats)]
    steps = [r.own_step_ms for r in runs]
    return {"tpot_ms": statistics.median(r.tpot_ms for r in runs), "step_ms": statistics.median(steps),
            "step_ms_min": min(steps), "step_ms_max": max(steps),
            "decode_step_ms": statistics.median(r.decode_step_ms for r in runs),
            "tokens_per_step": statistics.mean(r.tokens_per_step for r in runs),
            "outputs": runs[-1].outputs, "widths": runs[-1].widths}


def kernel_profile(pair: Pair, device: torch.device, prompt: list[int], kernels: str, steps: int = 12,
                   top: int = 14) -> dict:
    """CUDA kernel time per step by kernel name (torch.profiler over an eager engine: the same kernels a captured
    graph replays, with their launches visible)."""
    from torch.profiler import ProfilerActivity, profile

    if device.type != "cuda":
        return {}
    engine = Engine(pair.cfg, pair.tensors, Dist(0, 1, device),
                                 RuntimeConfig(device=device.type, compile="off", kernels=kernels, speculate="full"))
    out = {}
    for mode in ("ar", "redrafter"):
        generate(engine, [prompt], SamplingConfig(max_tokens=4), mode)
        engine.step_times.reset()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            generate(engine, [prompt], SamplingConfig(max_tokens=steps), mode)
        n = max(1, engine.step_times.steps[mode] + 1)  # decode steps + the prompt step
        rows = sorted(((e.key, e.device_time_total / 1e3 / n, e.count / n) for e in prof.key_averages()
                       if e.device_time_total > 0), key=lambda r: -r[1])
        out[mode] = {"gpu_ms_per_step": sum(r[1] for r in rows), "top": [
            {"kernel": k[:90], "ms_per_step": round(ms, 4), "calls_per_step": round(c, 1)} for k, ms, c in rows[:top]]}
    del engine
    return out


def hf_generate_ms(hf, prompts: list[list[int]], max_tokens: int) -> tuple[float, list]:
    """ms per token of HF generate over `prompts` batched (the whole call over max_tokens, after a warm-up)."""
    hf_generate(hf, prompts, 8)
    seconds, out = hf_generate(hf, prompts, max_tokens)
    return seconds * 1e3 / max_tokens, out


def parity_report(engine: Engine, hf, prompts: list[list[int]], max_tokens: int, device: torch.device) -> dict:
    """Greedy AR vs ReDrafter vs HF generate, one prompt at a time. Where two outputs first differ, the reference
    (HF's own logits for the common prefix) says how close its top two logits were: a divergence at a near-tie is
    rounding (matmul shapes differ between a 25-token verify, a 1-token AR step and HF's kernels), anything else
    would be a bug."""
    from transformers import GenerationConfig  # noqa: F401  (HF must be importable)

    out = {"prompts": len(prompts), "ar_eq_rd": 0, "ar_eq_hf": 0, "divergences": []}
    params = SamplingConfig(max_tokens=max_tokens)
    for p in prompts:
        ar, rd = (run_mode(engine, [p], params, mode).outputs[0] for mode in ("ar", "redrafter"))
        _, hf_out = hf_generate(hf, [p], max_tokens)
        hf_ids = hf_out[0]
        out["ar_eq_rd"] += ar == rd
        out["ar_eq_hf"] += ar == hf_ids
        for name, a, b in (("rd_vs_ar", rd, ar), ("ar_vs_hf", ar, hf_ids)):
            k = common_prefix(a, b)
            if k < len(b):
                with torch.no_grad():
                    logits = hf(torch.tensor([p + b[:k]], device=device)).logits[0, -1].float()
                top = logits.topk(2).values
                ulp = torch.finfo(logits.dtype if logits.dtype != torch.float32 else torch.bfloat16).eps
                out["divergences"].append({"pair": name, "at": k, "top2_gap": float(top[0] - top[1]),
                                           "gap_in_bf16_ulps_of_top": float((top[0] - top[1]) / (ulp * top[0].abs()))})
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def oracle_main(args) -> int:
    """AR vs ReDrafter with a rate oracle, --speculate full and auto, at every batch: ms/token, tokens/step, the
    step ratio, and the crossover batch (the first where ReDrafter is slower than AR) of each."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    batches = [int(b) for b in args.batches.split(",")]
    dl = args.beam_length - 1
    max_seq = args.prompt_len + args.max_tokens + 8
    t0 = time.perf_counter()
    pair = random_pair(args.shape, args.num_beams, dl, max(batches), args.prompt_len, max_seq, device, dtype,
                       args.seed, successor=True)
    del pair.hf
    m = pair.cfg.checkpoint.model
    print(f"built the random pair in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    continuations: dict[tuple[int, ...], list[int]] = {}  # each prompt's AR output, measured first
    oracle = ContinuationOracle(args.num_beams, dl, m.vocab_size, continuations, key="prompt",
                                tokens_per_step=args.oracle_tokens_per_step, seed=args.seed)
    doc = {"shape": args.shape, "dtype": args.dtype, "num_beams": args.num_beams, "beam_length": args.beam_length,
           "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "repeats": args.repeats,
           "oracle_tokens_per_step": args.oracle_tokens_per_step, "per_token_acceptance": oracle.p,
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
           "torch": torch.__version__, "runs": []}
    engines = {}
    for compile_mode in args.compile.split(","):
        for speculate in ("full", "auto"):
            t0 = time.perf_counter()
            engine = Engine(pair.cfg, pair.tensors, Dist(0, 1, device),
                                         RuntimeConfig(device=device.type, compile=compile_mode,
                                                       kernels=args.kernels.split(",")[0], speculate=speculate),
                                         proposer=oracle)
            engines[speculate] = engine
            print(f"engine ({compile_mode}, speculate {speculate}) ready in {time.perf_counter() - t0:.1f}s",
                  file=sys.stderr, flush=True)
        for b in batches:
            prompts = prompts_for(b, args.prompt_len, m.vocab_size, args.seed + b)
            ar = measure(engines["full"], prompts, args.max_tokens, "ar", args.repeats)
            continuations.update({tuple(p): o for p, o in zip(prompts, ar["outputs"])})
            row = {"compile": engines["full"].compiler.mode, "kernels": engines["full"].kernels, "batch": b,
                   "ar_tpot_ms": ar["tpot_ms"], "ar_step_ms": ar["step_ms"]}
            for speculate, engine in engines.items():
                rd = measure(engine, prompts, args.max_tokens, "redrafter", args.repeats)
                # step_ms: tree steps only (None: the policy took none); host time: per decode step of any kind
                row[speculate] = {"tpot_ms": rd["tpot_ms"], "step_ms": rd["step_ms"] or None,
                                  "host_ms_per_step": rd["tpot_ms"] * rd["tokens_per_step"] - rd["decode_step_ms"],
                                  "tokens_per_step": rd["tokens_per_step"], "speedup": ar["tpot_ms"] / rd["tpot_ms"],
                                  "equals_ar": sum(a == r for a, r in zip(ar["outputs"], rd["outputs"])),
                                  "widths": rd["widths"]}
            row["ar_host_ms_per_step"] = ar["tpot_ms"] - ar["step_ms"]
            row["full_step_ratio"] = row["full"]["step_ms"] / ar["step_ms"]
            doc["runs"].append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        for speculate in engines:
            slower = [r["batch"] for r in doc["runs"] if r[speculate]["speedup"] < 1.0]
            doc[f"crossover_{speculate}"] = min(slower) if slower else None
        engines.clear()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"\n{doc['device']}, {args.shape} {args.dtype}, nb={args.num_beams} beam length={args.beam_length}, "
          f"rate oracle {args.oracle_tokens_per_step} tokens/step (p={oracle.p:.3f} per drafted token), prompt "
          f"{args.prompt_len} + {args.max_tokens} tokens, greedy")
    print("| batch | AR ms/token | full: ms/token | tokens/step | RD/AR step | speedup | auto: ms/token | tokens/step "
          "| speedup | outputs == AR (full, auto) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in doc["runs"]:
        f, a = r["full"], r["auto"]
        print(f"| {r['batch']} | {r['ar_tpot_ms']:.2f} | {f['tpot_ms']:.2f} | {f['tokens_per_step']:.2f} | "
              f"{r['full_step_ratio']:.2f} | {f['speedup']:.2f}x | {a['tpot_ms']:.2f} | {a['tokens_per_step']:.2f} | "
              f"{a['speedup']:.2f}x | {f['equals_ar']}/{r['batch']}, {a['equals_ar']}/{r['batch']} |")
    print(f"crossover (first batch where ReDrafter is slower than AR): full {doc['crossover_full']}, "
          f"auto {doc['crossover_auto']}")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="vicuna-7b")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--num-beams", type=int, default=6)
    ap.add_argument("--beam-length", type=int, default=5, help="Apple's beam length: the true token + drafted tokens")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compile", default="auto", help="comma-separated RuntimeConfig.compile values to compare")
    ap.add_argument("--kernels", default="auto", help="comma-separated RuntimeConfig.kernels values to compare")
    ap.add_argument("--quantize", default="none",
                    help="comma-separated base forms to compare on the same weights: none (the float base), fp8 "
                         "(calibrated on 8 random prompts), int8_wo, int4_wo")
    ap.add_argument("--hf-batches", default="1", help="batch sizes to time HF generate at ('' to skip)")
    ap.add_argument("--assumed-tokens-per-step", type=float, default=3.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true", help="also list each kernel's time per step (eager engine)")
    ap.add_argument("--parity-prompts", type=int, default=0,
                    help="greedy AR vs ReDrafter vs HF on this many prompts, with the logit gap where they diverge")
    ap.add_argument("--oracle-tokens-per-step", type=float, default=0.0,
                    help="draft with a host oracle at this mean acceptance (tokens/step of a full tree) instead of "
                         "the random drafter, and compare --speculate full (every tree verified whole) with auto (the "
                         "speculation policy): ms/token per batch and where ReDrafter stops paying")
    ap.add_argument("--drafter-weights", default="",
                    help="comma-separated RuntimeConfig.drafter_weights values to compare ('' = as stored, int8)")
    ap.add_argument("--draft-vocab", type=int, default=0,
                    help="K > 0: the drafter's head scores K token ids (a draft vocabulary) instead of the vocabulary")
    ap.add_argument("--overheads", action="store_true",
                    help="also measure each engine's step cost model and print what speculating costs: the width-1 "
                         "tree step over the AR step (fixed cost) and each further verified node, per batch bucket")
    ap.add_argument("--output", default="out/gpu_bench.json")
    args = ap.parse_args()
    if args.oracle_tokens_per_step:
        return oracle_main(args)

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    batches = [int(b) for b in args.batches.split(",")]
    dl = args.beam_length - 1
    max_seq = args.prompt_len + args.max_tokens + 8
    t0 = time.perf_counter()
    pair = random_pair(args.shape, args.num_beams, dl, max(batches), args.prompt_len, max_seq, device, dtype,
                       args.seed, draft_vocab=args.draft_vocab)
    print(f"built the random pair in {time.perf_counter() - t0:.1f}s: base {pair.base_bytes / 1e9:.2f} GB, "
          f"drafter {pair.drafter_bytes / 1e9:.2f} GB", file=sys.stderr)
    bw = copy_bandwidth(device)
    m = pair.cfg.checkpoint.model
    kv_per_token = 2 * m.num_hidden_layers * m.num_key_value_heads * m.head_size * pair.tensors[
        "transformer.ln_f.weight"].element_size()
    doc = {"shape": args.shape, "dtype": args.dtype, "num_beams": args.num_beams, "beam_length": args.beam_length,
           "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "repeats": args.repeats,
           "draft_vocab": args.draft_vocab,
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
           "torch": torch.__version__, "copy_bandwidth_GBps": bw / 1e9, "base_GB": pair.base_bytes / 1e9,
           "drafter_GB": pair.drafter_bytes / 1e9, "runs": []}
    mean_ctx = args.prompt_len + args.max_tokens / 2
    hf_ms = {}
    for b in [int(x) for x in args.hf_batches.split(",") if x]:
        hf_ms[b], hf_out = hf_generate_ms(pair.hf, prompts_for(b, args.prompt_len, m.vocab_size, args.seed),
                                          args.max_tokens)
        doc[f"hf_generate_ms_per_token_b{b}"] = hf_ms[b]
        if b == 1:
            doc["hf_outputs_b1"] = hf_out
    calib_ids = prompts_for(8, args.prompt_len, m.vocab_size, args.seed + 13)
    for quant, compile_mode, kernels, dweights in [(q, c, k, w) for q in args.quantize.split(",")
                                                   for c in args.compile.split(",") for k in args.kernels.split(",")
                                                   for w in args.drafter_weights.split(",")]:
        runtime = RuntimeConfig(device=device.type, compile=compile_mode, kernels=kernels, speculate="full",
                                drafter_weights=dweights)
        t0 = time.perf_counter()
        cfg, tensors = quantized(pair, quant, calib_ids)
        engine = Engine(cfg, tensors, Dist(0, 1, device), runtime)
        del tensors
        warm = time.perf_counter() - t0
        if args.overheads:
            model = engine.cost_model()
            doc.setdefault("overheads", {})[f"{quant},{compile_mode},{kernels},{dweights}"] = model.overheads()
            print(f"speculation overheads ({quant}, {engine.compiler.mode}, {engine.kernels}, drafter weights "
                  f"{dweights or 'as stored'}):\n"
                  f"{model.overhead_table()}\n{model.table()}", file=sys.stderr, flush=True)
        for b in batches:
            prompts = prompts_for(b, args.prompt_len, m.vocab_size, args.seed)
            ar = measure(engine, prompts, args.max_tokens, "ar", args.repeats)
            rd = measure(engine, prompts, args.max_tokens, "redrafter", args.repeats)
            floor_ms = (quantized_base_bytes(pair, cfg) + b * mean_ctx * kv_per_token) / bw * 1e3
            row = {"quantize": quant, "drafter_weights": dweights, "kernels": engine.kernels,
                   "compile": engine.compiler.mode, "batch": b, "warmup_s": warm,
                   "ar_step_ms": ar["step_ms"], "ar_tpot_ms": ar["tpot_ms"],
                   "rd_step_ms": rd["step_ms"], "rd_tpot_ms": rd["tpot_ms"], "rd_tokens_per_step": rd["tokens_per_step"],
                   "step_ratio": rd["step_ms"] / ar["step_ms"], "ar_roofline_ms": floor_ms,
                   "ar_fraction_of_roofline": floor_ms / ar["step_ms"],
                   # int8 drafter weights: half the bytes (biases and scales aside)
                   "rd_drafter_floor_ms": dl * pair.drafter_bytes * (0.5 if dweights == "int8" else 1) / bw * 1e3,
                   "projected_rd_ms_per_token": rd["step_ms"] / args.assumed_tokens_per_step,
                   "projected_speedup": ar["step_ms"] * args.assumed_tokens_per_step / rd["step_ms"],
                   "ar_equals_redrafter": [common_prefix(a, r) for a, r in zip(ar["outputs"], rd["outputs"])],
                   "ar_step_ms_range": [ar["step_ms_min"], ar["step_ms_max"]],
                   "rd_step_ms_range": [rd["step_ms_min"], rd["step_ms_max"]]}
            if b == 1 and "hf_outputs_b1" in doc:
                row["ar_equals_hf_prefix"] = common_prefix(ar["outputs"][0], doc["hf_outputs_b1"][0])
                row["ar_vs_hf_speedup"] = hf_ms[1] / ar["tpot_ms"]
            if b == 1:
                row["phases_ms"], row["phases_speculate"] = phase_profile(engine, prompts[:1],
                                                                          SamplingConfig(max_tokens=args.max_tokens))
                if args.parity_prompts:
                    row["parity"] = parity_report(engine, pair.hf, prompts_for(args.parity_prompts, args.prompt_len,
                                                                               m.vocab_size, args.seed + 7),
                                                  args.max_tokens, device)
            doc["runs"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "outputs"}), file=sys.stderr, flush=True)
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if args.profile and kernels not in doc.get("kernel_profile", {}):
            doc.setdefault("kernel_profile", {})[kernels] = kernel_profile(
                pair, device, prompts_for(1, args.prompt_len, m.vocab_size, args.seed)[0], kernels)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    doc.pop("hf_outputs_b1", None)

    print(f"\n{doc['device']}, {args.shape} {args.dtype}, nb={args.num_beams} beam length={args.beam_length}, "
          f"prompt {args.prompt_len} + {args.max_tokens} tokens; copy bandwidth {bw / 1e9:.0f} GB/s; "
          f"HF generate " + ", ".join(f"b{b}: {v:.2f} ms/token" for b, v in hf_ms.items()))
    print("| base | drafter weights | compile | kernels | batch | AR step ms | roofline ms | AR % of roofline | RD step ms | RD/AR step | "
          "drafter floor ms | RD tokens/step (random) | projected RD ms/token @" f"{args.assumed_tokens_per_step} | "
          "projected speedup |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in doc["runs"]:
        print(f"| {r['quantize']} | {r['drafter_weights'] or 'as stored'} | {r['compile']} | {r['kernels']} | "
              f"{r['batch']} | {r['ar_step_ms']:.2f} | {r['ar_roofline_ms']:.2f} | "
              f"{100 * r['ar_fraction_of_roofline']:.0f}% | {r['rd_step_ms']:.2f} | {r['step_ratio']:.2f} | "
              f"{r['rd_drafter_floor_ms']:.2f} | {r['rd_tokens_per_step']:.2f} | {r['projected_rd_ms_per_token']:.2f} | "
              f"{r['projected_speedup']:.2f} |")
    for r in doc["runs"]:
        if "phases_ms" in r:
            ph = r["phases_ms"]
            total = sum(ph.values()) or 1.0
            print(f"phases ({r['quantize']}, {r['compile']}, {r['kernels']}, batch 1): " + ", ".join(f"{k} {v:.3f} ms ({100 * v / total:.0f}%)"
                                                                    for k, v in ph.items()))
    for r in doc["runs"]:
        if "parity" in r:
            pr = r["parity"]
            print(f"greedy parity ({r['quantize']}, {r['compile']}, {r['kernels']}, {args.dtype}): ReDrafter == AR on {pr['ar_eq_rd']}/"
                  f"{pr['prompts']} prompts, AR == HF on {pr['ar_eq_hf']}/{pr['prompts']}; divergences (reference "
                  f"top-2 logit gap in bf16 ulps): " + ", ".join(f"{d['pair']}@{d['at']}: {d['gap_in_bf16_ulps_of_top']:.1f}"
                                                               for d in pr["divergences"]))
    for kernels, prof in doc.get("kernel_profile", {}).items():
        for mode, p in prof.items():
            print(f"kernels per {mode} step ({kernels}, eager, batch 1): {p['gpu_ms_per_step']:.3f} ms of GPU time")
            for r in p["top"]:
                print(f"    {r['ms_per_step']:8.4f} ms  x{r['calls_per_step']:<6} {r['kernel']}")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(doc, indent=1))
    print(json.dumps({k: v for k, v in doc.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
