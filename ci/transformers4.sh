#!/usr/bin/env bash
# CI lane: the code paths NVIDIA's TensorRT-LLM 1.0-1.2 containers use (convert, build-engine, the trtllm backend's
# CPU tests, tokenizer loading, make-repo and the Triton text models through a real tritonserver: these files' fast
# tier, whose tritonserver test is marked core), under the oldest transformers the project supports (pyproject.toml:
# 4.53), in a second virtualenv that sees the main environment's packages but its own transformers (and the
# tokenizers / huggingface-hub that one needs). The stub of the Python
# backend finds its packages through `python3` on PATH, which the launcher points at this venv, so the Triton text
# models load their tokenizers with 4.53 too.
set -euo pipefail
cd "$(dirname "$0")/.."
TRANSFORMERS="${TRANSFORMERS:-transformers==4.53.*}"
VENV="${VENV:-${TMPDIR:-/tmp}/trt-redrafter-transformers4}"
[ -x "$VENV/bin/python" ] || python3 -m venv --system-site-packages "$VENV"
# the main environment's trt-redrafter requires what this lane replaces; pip's resolver warning about it is expected
if ! out=$("$VENV/bin/python" -m pip install -q --disable-pip-version-check "$TRANSFORMERS" 2>&1); then
    echo "$out"; exit 1
fi
echo "$out" | grep -v "dependency resolver\|requires transformers\|Running pip as the 'root'" || true
"$VENV/bin/python" -c 'import transformers; print("transformers", transformers.__version__, "in", transformers.__file__)'
"$VENV/bin/python" -m pytest -q -p no:cacheprovider \
    tests/test_transformers_compat.py tests/test_make_tiny.py tests/test_convert.py tests/test_convert_refusals.py \
    tests/test_chat_template.py tests/test_make_repo.py tests/test_triton_contract.py tests/test_trtllm_backend.py \
    tests/test_trtllm_sources.py tests/test_readers.py tests/test_serving_modes.py
