"""How fast the distillation corpus is written: the project's engine (`train-drafter --generator engine`) against HF
`generate` (`--generator hf`), on the same prompts, threads and dtype, in one run.

The prompts are Magpie user prompts the base writes itself (as `train-drafter --magpie` makes them), put in the chat
template; each generator answers all of them greedily, up to --seq-len tokens or the end of the turn, and hands back
the hidden states the corpus stores. Prints tokens/s of each, their ratio, and how many rows have the same tokens.

    python scripts/bench_corpus.py --base-model out/smollm2/hf --num 128 --engine float32:64 bfloat16:64 --threads 2
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from trt_redrafter.chat import chat_ids
from trt_redrafter.training import generation, prompts as prompt_mod
from trt_redrafter.training.sources import load_base, load_tokenizer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-model", type=Path, required=True)
    ap.add_argument("--num", type=int, default=128, help="prompts")
    ap.add_argument("--seq-len", type=int, default=256, help="most tokens per answer")
    ap.add_argument("--engine", nargs="+", default=["float32:64", "bfloat16:64"], metavar="DTYPE:BATCH",
                    help="engine runs: dtype and in-flight batch of each")
    ap.add_argument("--hf-batch", type=int, default=32, help="HF generate's batch (one shard per call, float32)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--json", type=Path, help="write the results here too")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok, _ = load_tokenizer(args.base_model)
    stop = [tok.eos_token_id]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    results: dict = {"model": str(args.base_model), "threads": args.threads, "seq_len": args.seq_len, "runs": {}}
    answers, prompts = {}, None

    def timed(name: str, gen, b: int) -> None:
        shard = lambda i: prompts[i * b:(i + 1) * b]  # noqa: E731
        t0 = time.perf_counter()
        rows = [r for _, sh in gen.shards(list(range(-(-len(prompts) // b))), shard, args.seq_len, stop, pad)
                for r in _rows(sh)]
        dt = time.perf_counter() - t0
        n = sum(len(o) for o in rows)
        answers[name] = rows
        results["runs"][name] = {"seconds": round(dt, 1), "tokens": n, "tokens_per_s": round(n / dt, 1)}
        print(f"{name}: {n} tokens in {dt:.1f}s = {n / dt:.1f} tokens/s", flush=True)

    for spec in args.engine:
        dtype, b = spec.split(":")
        gen = generation.EngineGenerator(args.base_model, dtype, torch.device("cpu"), int(b), 512, args.seq_len,
                                         args.threads, compile="auto")
        if prompts is None:  # Magpie prompts, written once (by the first engine) and answered by every run
            users = prompt_mod.magpie_user_prompts(gen.sample, tok, args.num, seed=12345)
            prompts = [chat_ids(tok, [{"role": "user", "content": u}]) for u in users]
            results["prompts"] = len(prompts)
            results["prompt_tokens_mean"] = round(sum(map(len, prompts)) / len(prompts), 1)
        timed(f"engine {dtype} batch {b}", gen, int(b))
        gen.close()
        del gen
    if not args.skip_hf:
        hf = generation.HFGenerator(load_base(args.base_model, torch.device("cpu")), torch.device("cpu"))
        ref = f"HF generate float32 batch {args.hf_batch}"
        timed(ref, hf, args.hf_batch)
        for name in list(results["runs"]):
            if name == ref:
                continue
            run = results["runs"][name]
            run["speedup_vs_hf"] = round(run["tokens_per_s"] / results["runs"][ref]["tokens_per_s"], 2)
            run["answers_equal_to_hf"] = sum(a == e for a, e in zip(answers[ref], answers[name]))
            print(f"{name}: {run['speedup_vs_hf']:.2f}x HF generate; {run['answers_equal_to_hf']}/{len(prompts)} "
                  f"answers token-identical to HF's")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


def _rows(shard) -> list[list[int]]:
    """Each row's generated tokens (after its prompt)."""
    return [shard.tokens[r, f + 1:n].tolist() for r, (f, n) in enumerate(zip(shard.first.tolist(),
                                                                             shard.length.tolist()))]


if __name__ == "__main__":
    sys.exit(main())
