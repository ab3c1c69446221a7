#!/usr/bin/env bash
# CUDA lane: check the GPU is visible, then nox (which runs `nox -s tests-cuda`).
#
# tests-cuda's venv sees the system site-packages: a CUDA torch already in this
# Python that satisfies pyproject's range is kept; otherwise pip installs the
# PyPI Linux build, which is the CUDA one.
set -euo pipefail

PYTHON=${PYTHON:-python}

if ! command -v nvidia-smi >/dev/null; then
    echo "cuda lane: nvidia-smi not found; is the NVIDIA driver installed on this runner?" >&2
    exit 1
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv

"$PYTHON" -m pip install nox
