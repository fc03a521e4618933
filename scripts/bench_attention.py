#!/usr/bin/env python3
"""Times the CPU tree-attention kernel (`trt_redrafter_cpu::tree_attention`, trt_redrafter/cpu/attention.cpp) alone,
one layer's call, by committed context and new tokens T (1: an AR step; more: a draft tree, causal chain), at a
model's head shape (default SmolLM2-135M's: 9 heads, 3 KV heads, head size 64), on random K/V in a paged cache.

    python scripts/bench_attention.py [--contexts 32,256,1024] [--tokens 1,2,5,9,17] [--dtypes float32,bfloat16]
        [--batch 1] [--heads 9 --kv-heads 3 --head-size 64] [--threads 2] [--against OTHER_CHECKOUT]

`--against CHECKOUT` builds that checkout's attention.cpp too (under another op namespace) and times both kernels
in turn, call after call, so that the machine's slow phases fall on both alike, and says whether their outputs are
bitwise equal. Prints the median microseconds of `--calls` calls per point, and the load average; the last stdout
line is one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch

from trt_redrafter import cpu


def case(dtype: torch.dtype, bs: int, T: int, ctx: int, nh: int, nkv: int, D: int, block: int = 64):
    g = torch.Generator().manual_seed(0)
    nblk = (ctx + T + block - 1) // block
    kc, vc = (torch.randn(bs * nblk * block, nkv, D, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(bs, T, nh, D, generator=g).to(dtype)
    block_table = torch.randperm(bs * nblk, generator=g).view(bs, nblk)  # blocks out of order, as a paged cache's
    mask = torch.ones(T, T, dtype=torch.bool).tril().expand(bs, T, T).contiguous()
    return q, kc, vc, block_table, torch.full((bs,), ctx), mask, block


def build_against(checkout: Path):
    """The tree_attention op of another checkout's sources, registered as trt_redrafter_cpu_against::tree_attention."""
    from torch.utils import cpp_extension

    src = checkout / "trt_redrafter" / "cpu"
    if not (src / "attention.cpp").is_file():
        raise SystemExit(f"error: {src / 'attention.cpp'} does not exist; pass a checkout of this project")
    build = Path(tempfile.mkdtemp(prefix="bench-attention-"))
    code = re.sub(r"TORCH_LIBRARY_(FRAGMENT|IMPL)\(trt_redrafter_cpu\b", r"TORCH_LIBRARY_\1(trt_redrafter_cpu_against",
                  (src / "attention.cpp").read_text())
    (build / "attention.cpp").write_text(code)
    for h in src.glob("*.h"):
        (build / h.name).write_text(h.read_text())
    cpp_extension.load(name="trt_redrafter_cpu_against", sources=[str(build / "attention.cpp")],
                       is_python_module=False, extra_cflags=cpu._CFLAGS, extra_ldflags=["-fopenmp"],
                       build_directory=str(build))
    return torch.ops.trt_redrafter_cpu_against.tree_attention


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="32,256,1024")
    ap.add_argument("--tokens", default="1,2,5,9,17")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-size", type=int, default=64)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--against", type=Path,
                    help="another checkout whose attention kernel to time in turn with this one")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kernels = {"this": cpu.ops().tree_attention}
    if args.against:
        kernels = {"against": build_against(args.against), **kernels}
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = []
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        if not cpu.available(dtype):
            print(f"{name}: {cpu.unavailable_reason(dtype)}; skipped")
            continue
        for ctx in (int(c) for c in args.contexts.split(",")):
            line = []
            for T in tokens:
                a = case(dtype, args.batch, T, ctx, args.heads, args.kv_heads, args.head_size)
                scale = args.head_size ** -0.5
                outs = {k: op(*a, scale) for k, op in kernels.items()}
                for _ in range(20):
                    for op in kernels.values():
                        op(*a, scale)
                times = {k: [] for k in kernels}
                for _ in range(args.calls):
                    for k, op in kernels.items():
                        t0 = time.perf_counter()
                        op(*a, scale)
                        times[k].append(time.perf_counter() - t0)
                us = {k: round(1e6 * statistics.median(t), 2) for k, t in times.items()}
                row = {"dtype": name, "context": ctx, "tokens": T, "us": us["this"]}
                if args.against:
                    row.update(against_us=us["against"], bitwise_equal=torch.equal(outs["this"], outs["against"]))
                    line.append(f"T={T} {us['against']:.1f} -> {us['this']:.1f} ({us['against'] / us['this']:.2f}x"
                                f"{'' if row['bitwise_equal'] else ', NOT bitwise equal'})")
                else:
                    line.append(f"T={T} {us['this']:7.1f}")
                rows.append(row)
            print(f"{name:8s} context {ctx:5d}: " + "  ".join(line) + " us"
                  + (" (--against -> this)" if args.against else ""), flush=True)
    print(f"batch {args.batch}, {args.heads} heads / {args.kv_heads} KV heads x {args.head_size}, {args.threads} "
          f"thread(s), load average {os.getloadavg()[0]:.2f}; median of {args.calls} calls")
    print(json.dumps({"rows": rows, "against": str(args.against) if args.against else None,
                      "batch": args.batch, "heads": args.heads, "kv_heads": args.kv_heads,
                      "head_size": args.head_size, "threads": args.threads, "loadavg": os.getloadavg()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
