#!/usr/bin/env bash
# Install everything trt-redrafter needs on a fresh Debian/Ubuntu machine (CPU): Open MPI, a C++ compiler (inductor's
# CPU kernels and the AVX-512 linear kernel are compiled on first use), the CPU PyTorch wheel, and this package with
# its dev, serving and bench extras. Idempotent; safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
if ! command -v mpirun >/dev/null 2>&1 || ! command -v g++ >/dev/null 2>&1; then
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq openmpi-bin g++ >/dev/null
fi
PIP="python3 -m pip install -q --disable-pip-version-check"
# torch first and pinned, so the dependency resolver does not pull a CUDA build
python3 -c 'import torch' 2>/dev/null || $PIP "torch==2.13.0" || $PIP "torch>=2.4"
$PIP -e ".[dev,serving,bench]"
