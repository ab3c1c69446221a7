#!/usr/bin/env bash
# CPU lane: the small CPU torch build, then nox (which runs `nox -s tests-cpu`).
#
# A plain `pip install torch` on Linux fetches the multi-GB CUDA build, so the
# CPU build comes from PyTorch's CPU-only index on GitHub runners. Elsewhere pip
# uses its configured sources (a local wheel cache, where there is one).
# Override with GRAPHRT_TORCH_INDEX_URL (empty: pip's configured sources).
set -euo pipefail

PYTHON=${PYTHON:-python}
TORCH_SPEC=${GRAPHRT_TORCH_SPEC:-torch==2.13.0}  # keep in step with TORCH_CPU in noxfile.py

if [[ -z ${GRAPHRT_TORCH_INDEX_URL+set} && ${GITHUB_ACTIONS:-} == true ]]; then
    GRAPHRT_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
fi
index_args=()
if [[ -n ${GRAPHRT_TORCH_INDEX_URL:-} ]]; then
    index_args=(--index-url "$GRAPHRT_TORCH_INDEX_URL")
    # nox's tests-cpu venv installs torch again; it reads this to use the same index.
    if [[ -n ${GITHUB_ENV:-} ]]; then
        echo "GRAPHRT_TORCH_INDEX_URL=$GRAPHRT_TORCH_INDEX_URL" >>"$GITHUB_ENV"
    fi
fi

# Installed here as well as in the nox venv: this fills pip's cache, so the
# venv's install is a local copy rather than a second download.
"$PYTHON" -m pip install "$TORCH_SPEC" "${index_args[@]}"
"$PYTHON" -m pip install nox
