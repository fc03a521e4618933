"""Measuring ms/token of ReDrafter against auto-regressive decoding, and gating CI on it (docs/perf.md).

Served (`trt-redrafter bench`, `gate`):
    schedule.py      prompts from a JSONL dataset (MT-Bench with the Vicuna template, or {"prompt": ...}) and
                     Poisson arrival times, both fixed by the seed
    metrics.py       per-request records -> TTFT, TPOT (ms/token), ITL, E2E percentiles, throughput, tokens/step
    harness.py       BenchConfig; start servers on engine dirs; the interleaved repeat x QPS x TP x mode sweep
    report.py        the results document (config, git revision, machine, every point), its markdown table
    plots.py         ms/token vs QPS and speedup vs QPS (matplotlib, Agg)
    gate.py          the CI gate: speedup ratios, tokens/step and errors against a committed baseline
The engine alone (`trt-redrafter bench-engine`, scripts/gpu_bench.py):
    engine_bench.py  AR vs each proposer on one engine, the modes alternating per prompt group; its rows, table, JSON
    measure.py       one mode's timed run, the phase profile, the round schedule, a ratio's spread over rounds
    baselines.py     HF `generate` and llama.cpp on the same token ids, each in a process of its own
    oracle.py        a proposer that drafts the known continuation at a set acceptance (benchmarks, tests)
The docs (`scripts/render_docs.py`):
    docs_tables.py   the tables of docs/perf.md, models.md and serving.md, rendered from the committed JSON results

Nothing here imports tritonclient, matplotlib or the serving stack at module level: the metrics and the gate
are plain arithmetic on recorded JSON, testable anywhere.
"""
