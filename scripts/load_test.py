#!/usr/bin/env python3
"""Open-loop load test of a served model: Poisson arrivals at --rate requests/s for --duration seconds.

Each request is one gRPC stream (trt_redrafter.serving.client.generate_one) with a fixed output length
(end_id -1), so every request costs the same. Reports errors, throughput, client-side TTFT and ms/token
percentiles and the deepest scheduler queue seen on /metrics; the last stdout line is one JSON document.

    python scripts/load_test.py --repo REPO --rate 4 --duration 30          # starts and stops its own server
    python scripts/load_test.py --url 127.0.0.1:8001 --metrics-url http://127.0.0.1:8002/metrics --rate 4
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time

from trt_redrafter.serving.client import GenerationRequest, generate_one
from trt_redrafter.serving.metrics import scrape, sum_metric

PROMPTS = ["The quick brown fox", "Hello world, this is", "import os", "def main():", "Once upon a time",
           "Serving ReDrafter with Triton", "a b c d e f g", "In-flight batching means"]


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_load(url: str, metrics_url: str | None, rate: float, duration: float, max_tokens: int, seed: int) -> dict:
    rng = random.Random(seed)
    outs, threads = [], []
    lock = threading.Lock()
    peak = {"waiting": 0.0, "running": 0.0}
    done = threading.Event()

    def watch():
        while not done.wait(0.1):
            try:
                m = scrape(metrics_url)
            except OSError:
                continue
            peak["waiting"] = max(peak["waiting"], sum_metric(m, "trt_redrafter_waiting_requests"))
            peak["running"] = max(peak["running"], sum_metric(m, "trt_redrafter_active_requests"))

    def one(i: int):
        req = GenerationRequest(prompt=f"{PROMPTS[i % len(PROMPTS)]} {i}", max_tokens=max_tokens, end_id=-1)
        out = generate_one(url, req, timeout=600)
        with lock:
            outs.append(out)

    watcher = threading.Thread(target=watch, daemon=True) if metrics_url else None
    if watcher:
        watcher.start()
    t0 = time.perf_counter()
    i, next_t = 0, 0.0
    while next_t < duration:
        delay = t0 + next_t - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        th = threading.Thread(target=one, args=(i,))
        th.start()
        threads.append(th)
        i += 1
        next_t += rng.expovariate(rate)
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    done.set()
    ok = [o for o in outs if o.error is None and o.final and len(o.output_ids) == max_tokens]
    ttft = [o.ttft_s * 1e3 for o in ok if o.ttft_s is not None]
    tpot = [o.ms_per_token for o in ok if o.ms_per_token is not None]
    e2e = [o.e2e_s for o in ok if o.e2e_s is not None]
    return {
        "offered_rate": rate, "duration_s": duration, "sent": len(outs), "completed": len(ok),
        "errors": len(outs) - len(ok), "error_samples": sorted({o.error for o in outs if o.error})[:3],
        "achieved_rps": round(len(ok) / wall, 3), "output_tokens_per_s": round(len(ok) * max_tokens / wall, 1),
        "max_tokens": max_tokens,
        "ttft_ms_p50": pct(ttft, 0.5), "ttft_ms_p90": pct(ttft, 0.9),
        "ms_per_token_p50": pct(tpot, 0.5), "ms_per_token_p90": pct(tpot, 0.9),
        "e2e_s_mean": statistics.mean(e2e) if e2e else None,
        "peak_waiting": peak["waiting"], "peak_running": peak["running"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--repo", help="start tritonserver on this model repository for the test")
    src.add_argument("--url", help="gRPC HOST:PORT of a running server")
    p.add_argument("--metrics-url", help="its /metrics URL (queue depth); implied with --repo")
    p.add_argument("--rate", type=float, nargs="+", required=True, help="offered load(s), requests/s")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per rate")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()

    def sweep(url, metrics_url):
        results = []
        for rate in a.rate:
            r = run_load(url, metrics_url, rate, a.duration, a.max_tokens, a.seed)
            print(json.dumps(r), flush=True)
            results.append(r)
        return results

    if a.repo:
        from trt_redrafter.runtime.distributed import free_port
        from trt_redrafter.serving.launcher import TritonServer

        with TritonServer(a.repo, grpc_port=free_port(), http_port=free_port(), metrics_port=free_port()) as srv:
            results = sweep(srv.grpc_url, srv.metrics_url)
    else:
        results = sweep(a.url, a.metrics_url)
    print(json.dumps({"load_test": results}))


if __name__ == "__main__":
    main()
