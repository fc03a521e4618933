#!/usr/bin/env python3
"""Tile search for the CUDA weight-only GEMM (trt_redrafter/plugins/weight_only.py) on this card.

For each kind of weight (int8 per channel, int4 per channel, int4 in groups of 128) and each candidate `Tiles`, it
runs the kernel at a 7B model's layer shapes (fused q/k/v, o, fused gate/up, down) and at the row counts a decode
step meets (1 and 8: AR at batch 1 and 8; 25 and 200: a 5-beam x 5-token tree's verify at batch 1 and 8), checks
every output against the dequantized weight and that the first rows' bits equal a 1-row call's, and times it with
`triton.testing.do_bench`. Beside each shape: cuBLAS on the bf16 weight and the HBM floor (the integer bytes and
scales over the card's copy bandwidth). Prints a table per kind and the best tiles (geometric mean of each case's
time over the best time for that case); the JSON (--output) holds every timing.

    python3 scripts/wo_gemm_tune.py --output out/wo-tune.json
    python3 scripts/wo_gemm_tune.py --shapes tiny --rows 1,5 --budget-s 60   # a dry run (TRITON_INTERPRET=1 on a CPU)

`--row-tiles 1,2,4` instead times the committed tiles with each count of row tiles per program (`row_tiles_for`
chooses by M) at every shape and M, beside cuBLAS and the floor.

`--apply` writes the best tiles into the module's table in this process (for a benchmark run right after:
`python3 -c 'import runpy, sys; ...'`); the committed table is edited by hand from the printed result.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout without installing

from trt_redrafter.plugins import weight_only  # noqa: E402
from trt_redrafter.plugins.weight_only import Tiles  # noqa: E402

SHAPES = {
    # name: [(label, N, K)]
    "vicuna-7b": [("qkv", 12288, 4096), ("o", 4096, 4096), ("gate_up", 22016, 4096), ("down", 4096, 11008)],
    "tiny": [("qkv", 96, 64), ("down", 64, 128)],
}
KINDS = {"int8": (8, None), "int4": (4, None), "int4_g128": (4, 128)}  # bits, group (None: per channel)


def candidates(kind: str) -> list[Tiles]:
    group = KINDS[kind][1]
    ks = [64, 128] if group == 128 else [128, 256, 512]
    ns = [32, 64, 16, 128] if group == 128 else [32, 64, 16]
    out = []
    for bn, bk, warps, stages in itertools.product(ns, ks, (2, 4), (3, 4)):
        if bn * bk <= 16384:
            out.append(Tiles(bn, bk, warps, stages))
    return out


def bench(fn, rep_ms: float) -> float:
    """Milliseconds per call: triton.testing.do_bench on a GPU; the median of a few calls elsewhere (a dry run)."""
    if torch.cuda.is_available():
        from triton.testing import do_bench
        return do_bench(fn, warmup=5, rep=rep_ms)
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return sorted(ts)[1]


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read + written per second by a 1 GiB device-to-device copy."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    ms = bench(lambda: b.copy_(a), 50)
    return 2 * a.numel() / (ms / 1e3)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="vicuna-7b")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--rows", default="1,8,25,200", help="row counts M")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--budget-s", type=float, default=240,
                    help="seconds of candidates in all, shared evenly by the kinds")
    ap.add_argument("--rep-ms", type=float, default=15)
    ap.add_argument("--apply", action="store_true", help="set weight_only.TILES to the best tiles in this process")
    ap.add_argument("--row-tiles", default="", help="e.g. 1,2,4: time the committed tiles with each count of row "
                    "tiles per program instead of searching tiles")
    ap.add_argument("--output")
    args = ap.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    rows = [int(m) for m in args.rows.split(",")]
    shapes = SHAPES[args.shapes]
    t_start = time.perf_counter()
    bw = copy_bandwidth(device) if device.type == "cuda" else float("nan")
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, copy bandwidth "
          f"{bw / 1e9:.0f} GB/s, {args.dtype}", flush=True)
    g = torch.Generator(device="cpu").manual_seed(0)
    x_all = {K: torch.randn(max(rows), K, generator=g).to(dtype).to(device) for _, _, K in shapes}
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "copy_gbs": bw / 1e9,
              "dtype": args.dtype, "rows": rows, "shapes": shapes, "cublas_ms": {}, "kinds": {}}
    for label, N, K in shapes:
        w = torch.randn(N, K, generator=g).to(dtype).to(device)
        result["cublas_ms"][label] = {m: bench(lambda xm=x_all[K][:m], w=w: xm @ w.T, args.rep_ms)
                                      for m in rows}
        del w
    if args.row_tiles:
        result["row_tiles"] = row_tile_table(args, shapes, rows, x_all, result["cublas_ms"], bw, g, device)
        if args.output:
            Path(args.output).write_text(json.dumps(result, indent=1, default=str))
        return 0
    best_tiles = {}
    kinds = args.kinds.split(",")
    for n_kind, kind in enumerate(kinds):
        bits, group = KINDS[kind]
        deadline = t_start + args.budget_s * (n_kind + 1) / len(kinds)
        weights = {}
        for label, N, K in shapes:
            q, s, gs = _weight(bits, group, N, K, g)
            ref_w = (q.float() * s.repeat_interleave(gs, dim=1)[:, :K]).to(device)
            weights[label] = (q, s, gs, ref_w, N, K)
        times: dict[Tiles, dict[tuple[str, int], float]] = {}
        packed: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        for tiles in candidates(kind):  # one row tile per program (`--row-tiles` times the others)
            if time.perf_counter() > deadline:
                print(f"  budget spent: {kind} stops after {len(times)} candidates", flush=True)
                break
            if group and group % tiles.block_k:
                continue
            t = {}
            try:
                for label, (q, s, gs, ref_w, N, K) in weights.items():
                    key = (label, tiles.block_k if bits == 4 else 0)  # int4's layout depends on block_k
                    if key not in packed:
                        packed[key] = tuple(t.to(device) for t in weight_only.pack(q, s, bits, gs, tiles))
                    pq, ps = packed[key]
                    x = x_all[K]
                    full = weight_only.wo_linear(x, pq, ps, bits, gs, tiles)
                    ref = x.float() @ ref_w.T
                    err = float((full.float() - ref).abs().max() / ref.abs().max())
                    one = weight_only.wo_linear(x[:1].contiguous(), pq, ps, bits, gs, tiles)
                    if err > 2e-2 or not torch.equal(one, full[:1]):
                        raise AssertionError(f"{label}: relative error {err:.2e}, "
                                             f"1-row call equal: {torch.equal(one, full[:1])}")
                    for m in rows:
                        xm = x[:m].contiguous()
                        t[(label, m)] = bench(lambda xm=xm, pq=pq, ps=ps, bits=bits, gs=gs, tiles=tiles:
                                              weight_only.wo_linear(xm, pq, ps, bits, gs, tiles), args.rep_ms)
            except Exception as e:  # noqa: BLE001 (a failing candidate is reported and skipped)
                print(f"  {kind} {tuple(tiles)}: {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
                continue
            times[tiles] = t
        if not times:
            continue
        cases = list(next(iter(times.values())))
        best_case = {c: min(t[c] for t in times.values() if c in t) for c in cases}
        score = {tl: math.exp(sum(math.log(t[c] / best_case[c]) for c in cases) / len(cases))
                 for tl, t in times.items() if len(t) == len(cases)}
        best = min(score, key=score.get)
        best_tiles[kind] = best
        floor = {label: (N * K * bits / 8 + N * (K // (group or K)) * 4) / bw * 1e3 for label, N, K in shapes}
        print(f"\n{kind}: {len(times)} candidates; best {tuple(best)} (score {score[best]:.3f}; block_n, block_k, "
              f"warps, stages)")
        print("| shape | M | best tiles ms | cuBLAS bf16 ms | HBM floor ms | floor / best |")
        print("|---|---|---|---|---|---|")
        for label, m in cases:
            b = times[best][(label, m)]
            print(f"| {label} | {m} | {b:.4f} | {result['cublas_ms'][label][m]:.4f} | {floor[label]:.4f} | "
                  f"{floor[label] / b:.0%} |")
        ranked = sorted(score, key=score.get)[:5]
        print("top 5: " + ", ".join(f"{tuple(r)} {score[r]:.3f}" for r in ranked), flush=True)
        result["kinds"][kind] = {"best": list(best), "score": score[best],
                                 "times": {",".join(map(str, tl)): {f"{lab}@{m}": v for (lab, m), v in t.items()}
                                           for tl, t in times.items()}}
    print(f"\nbest: {json.dumps({k: list(v) for k, v in best_tiles.items()})}  ({time.perf_counter() - t_start:.0f} s)")
    if args.apply:
        apply(best_tiles)
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1, default=str))
    return 0


def _weight(bits: int, group, N: int, K: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A random weight of this kind: int8 values q [N, K] in its range, scales [N, K / group], the group size."""
    gs = group or K
    lo, hi = (-128, 127) if bits == 8 else (-8, 7)
    q = torch.randint(lo, hi + 1, (N, K), generator=g, dtype=torch.int8)
    return q, 0.001 + 0.01 * torch.rand(N, -(-K // gs), generator=g), gs


def row_tile_table(args, shapes, rows: list[int], x_all, cublas_ms, bw: float, g: torch.Generator,
                   device: torch.device) -> dict:
    """ms per call of the committed tiles with each count of row tiles per program, per kind, shape and M; every
    call's output checked bit for bit against the 1-row-tile call's."""
    counts = [int(r) for r in args.row_tiles.split(",")]
    out = {}
    for kind in args.kinds.split(","):
        bits, group = KINDS[kind]
        tiles = weight_only.TILES[(bits, group is None)]
        default = ", ".join(f"{weight_only.row_tiles_for(m, tiles)} at M={m}" for m in rows)
        print(f"\n{kind}, tiles {tuple(tiles)}: ms per call by row tiles per program (the default takes {default})")
        print("| shape | M | " + " | ".join(f"{r} row tile{'s' if r > 1 else ''}" for r in counts)
              + " | cuBLAS bf16 | HBM floor |")
        print("|---|---|" + "---|" * (len(counts) + 2))
        for label, N, K in shapes:
            q, sc, gs = _weight(bits, group, N, K, g)
            pq, ps = (t.to(device) for t in weight_only.pack(q, sc, bits, gs))
            floor = (N * K * bits / 8 + N * (K // gs) * 4) / bw * 1e3
            for m in rows:
                xm = x_all[K][:m].contiguous()
                want = weight_only.wo_linear(xm, pq, ps, bits, gs, row_tiles=1)
                times = []
                for r in counts:
                    got = weight_only.wo_linear(xm, pq, ps, bits, gs, row_tiles=r)
                    if not torch.equal(got, want):
                        raise AssertionError(f"{kind} {label} M={m}: {r} row tiles per program changed the output")
                    times.append(bench(lambda xm=xm, r=r: weight_only.wo_linear(xm, pq, ps, bits, gs, row_tiles=r),
                                       args.rep_ms))
                out[f"{kind}:{label}@{m}"] = dict(zip(map(str, counts), times))
                print(f"| {label} | {m} | " + " | ".join(f"{t:.4f}" for t in times)
                      + f" | {cublas_ms[label][m]:.4f} | {floor:.4f} |", flush=True)
    return out


def apply(best: dict[str, Tiles]) -> None:
    """The searched block sizes into the kernel's table; each kind keeps its row tiles per program (the search runs
    one row tile per program; `--row-tiles` measures the others)."""
    for kind, tiles in best.items():
        bits, group = KINDS[kind]
        keys = [(bits, group is None)] + ([(8, False)] if kind == "int8" else [])  # int8 in groups takes int8's
        for key in keys:
            old = weight_only.TILES[key]
            weight_only.TILES[key] = tiles._replace(max_row_tiles=old.max_row_tiles, row_tiles_from=old.row_tiles_from)


if __name__ == "__main__":
    sys.exit(main())
