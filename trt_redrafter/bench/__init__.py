"""Measuring ms/token of ReDrafter against auto-regressive decoding, and gating CI on it (docs/perf.md).

    schedule.py  prompts from a JSONL dataset (MT-Bench with the Vicuna template, or {"prompt": ...}) and
                 Poisson arrival times, both fixed by the seed
    metrics.py   per-request records -> TTFT, TPOT (ms/token), ITL, E2E percentiles, throughput, tokens/step
    harness.py   BenchConfig; start servers on engine dirs; the interleaved repeat x QPS x TP x mode sweep
    report.py    the results document (config, git revision, machine, every point), its markdown table
    plots.py     ms/token vs QPS and speedup vs QPS (matplotlib, Agg)
    gate.py      the CI gate: speedup ratios, tokens/step and errors against a committed baseline

Nothing here imports tritonclient, matplotlib or the serving stack at module level: the metrics and the gate
are plain arithmetic on recorded JSON, testable anywhere.
"""
