"""How fast the distillation corpus is written: the project's engine (`train-drafter --generator engine`) against HF
`generate` (`--generator hf`), on the same prompts, threads and dtype, in one run.

The prompts are Magpie user prompts the base writes itself (as `train-drafter --magpie` makes them), put in the chat
template; each generator answers all of them greedily, up to --seq-len tokens or the end of the turn, and hands back
the hidden states the corpus stores. Prints tokens/s of each, their ratio, and how many rows have the same tokens.

    python scripts/bench_corpus.py --base-model out/smollm2/hf --num 128 --batch 32 64 --threads 2
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
from trt_redrafter.training.drafter_training import _load_base, _load_tokenizer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-model", type=Path, required=True)
    ap.add_argument("--num", type=int, default=128, help="prompts")
    ap.add_argument("--seq-len", type=int, default=256, help="most tokens per answer")
    ap.add_argument("--batch", type=int, nargs="+", default=[32, 64], help="engine batch sizes (in flight)")
    ap.add_argument("--hf-batch", type=int, default=32, help="HF generate's batch (one shard per call)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--json", type=Path, help="write the results here too")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok, _ = _load_tokenizer(args.base_model)
    stop = [tok.eos_token_id]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    dtype = getattr(torch, args.dtype)
    results: dict = {"model": str(args.base_model), "dtype": args.dtype, "threads": args.threads,
                     "seq_len": args.seq_len}
    answers = {}
    for b in args.batch:
        gen = generation.EngineGenerator(args.base_model, args.dtype, torch.device("cpu"), b, 512, args.seq_len,
                                         args.threads, compile="auto")
        if "prompts" not in results:
            users = prompt_mod.magpie_user_prompts(gen.sample, tok, args.num, seed=12345)
            prompts = [chat_ids(tok, [{"role": "user", "content": u}]) for u in users]
            results["prompts"] = len(prompts)
            results["prompt_tokens_mean"] = round(sum(map(len, prompts)) / len(prompts), 1)
        shard = lambda i: prompts[i * b:(i + 1) * b]  # noqa: E731
        n_shards = -(-len(prompts) // b)
        t0 = time.perf_counter()
        rows = [r for _, sh in gen.shards(list(range(n_shards)), shard, args.seq_len, stop, pad)
                for r in _rows(sh)]
        dt = time.perf_counter() - t0
        n = sum(len(o) for o in rows)
        answers[f"engine-{b}"] = rows
        results[f"engine_batch{b}"] = {"seconds": round(dt, 1), "tokens": n, "tokens_per_s": round(n / dt, 1)}
        print(f"engine batch {b}: {n} tokens in {dt:.1f}s = {n / dt:.1f} tokens/s", flush=True)
        gen.close()
        del gen
    if not args.skip_hf:
        model = _load_base(args.base_model, torch.device("cpu"), dtype)
        hf = generation.HFGenerator(model, torch.device("cpu"))
        b = args.hf_batch
        shard = lambda i: prompts[i * b:(i + 1) * b]  # noqa: E731
        t0 = time.perf_counter()
        rows = [r for _, sh in hf.shards(list(range(-(-len(prompts) // b))), shard, args.seq_len, stop, pad)
                for r in _rows(sh)]
        dt = time.perf_counter() - t0
        n = sum(len(o) for o in rows)
        results[f"hf_batch{b}"] = {"seconds": round(dt, 1), "tokens": n, "tokens_per_s": round(n / dt, 1)}
        print(f"HF generate batch {b}: {n} tokens in {dt:.1f}s = {n / dt:.1f} tokens/s", flush=True)
        for k, rows_e in answers.items():
            same = sum(a == e for a, e in zip(rows, rows_e))
            ratio = results[k.replace("-", "_batch")]["tokens_per_s"] / results[f"hf_batch{b}"]["tokens_per_s"]
            results[k.replace("-", "_batch")].update(speedup_vs_hf=round(ratio, 2), rows_equal_to_hf=same)
            print(f"{k}: {ratio:.2f}x HF generate; {same}/{len(rows)} answers token-identical to HF's")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


def _rows(shard) -> list[list[int]]:
    """Each row's generated tokens (after its prompt)."""
    return [shard.tokens[r, f + 1:n].tolist() for r, (f, n) in enumerate(zip(shard.first.tolist(),
                                                                             shard.length.tolist()))]


if __name__ == "__main__":
    sys.exit(main())
