#!/usr/bin/env bash
# From a fresh clone: install, make a tiny Llama + drafter, convert it for TP=2, build a torch engine, and decode
# the same prompt auto-regressively and with ReDrafter under mpirun. Everything lands in ./out/quickstart.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
OUT=${OUT:-out/quickstart}
rm -rf "$OUT"; mkdir -p "$OUT"
set -x
trt-redrafter make-tiny --output "$OUT/tiny" --seed 0
trt-redrafter convert --config builders/tiny.yaml --base-model "$OUT/tiny/base" --drafter "$OUT/tiny/drafter" \
    --output "$OUT/ckpt-tp2" --tp 2 --dtype float32
build-engine --config builders/tiny.yaml --checkpoint "$OUT/ckpt-tp2" --output "$OUT/engine-tp2" --tp 2 \
    --tokenizer "$OUT/tiny/base"
trt-redrafter run --engine "$OUT/engine-tp2" --mode ar --prompt "def fibonacci(n):" --max-tokens 32 --json
trt-redrafter run --engine "$OUT/engine-tp2" --mode redrafter --prompt "def fibonacci(n):" --max-tokens 32 --json
# the committed small trained pair: AR vs ReDrafter vs learning-free N-gram drafts vs mixed trees (and HF generate
# and its prompt lookup on the same prompts): ms/token, step cost and tokens/step, same engine, same run,
# compiled (inductor), one thread. One beam of 3 drafts: on a CPU this 1.3M-parameter model is compute-bound, so
# every verified tree token costs nearly as much as an AR step and a small tree pays best (docs/perf.md).
trt-redrafter convert --base-model models/small/base --drafter models/small/drafter --output "$OUT/small-ckpt" \
    --tp 1 --dtype float32 --num-beams 1 --draft-len-per-beam 3
build-engine --checkpoint "$OUT/small-ckpt" --output "$OUT/small-engine" --tokenizer models/small/base \
    --max-batch-size 8 --max-input-len 256 --max-seq-len 512
python3 scripts/bench_engine.py --engine "$OUT/small-engine" --num-prompts 8 --max-tokens 96 --repeats 3 \
    --batch-size 1,8 --threads 1 --hf-model models/small/base
