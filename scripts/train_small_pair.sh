#!/usr/bin/env bash
# Regenerate models/small/{base,drafter}: train the small stdlib Llama, then distil its ReDrafter drafter.
# CPU-only; about 10-25 minutes on 2 cores depending on load. Deterministic for a given Python version.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-models/small}
python scripts/train_base.py --output "$OUT/base" --seed 0 --steps 800 --batch-size 8 --seq-len 256 \
    --vocab-size 2048 --hidden-size 128 --intermediate-size 384 --num-layers 4 --num-heads 4 --num-kv-heads 2 \
    --threads 2 --force
trt-redrafter train-drafter --base-model "$OUT/base" --output "$OUT/drafter" --seed 0 --draft-len 4 --num-layers 1 \
    --rnn --exit-dim 256 --steps 600 --batch-size 512 --num-sequences 512 --seq-len 160 --lr 2e-3 --threads 2 --device cpu \
    --shards-in-memory 4 --force  # 4: the default when this drafter was trained (now: the whole corpus)
