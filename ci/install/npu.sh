#!/usr/bin/env bash
# Ascend NPU lane: toolkit environment, torch + torch-npu, then nox (which runs
# `nox -s tests-npu`).
#
# The toolkit's set_env.sh and TORCH_DEVICE_BACKEND_AUTOLOAD=0 must reach the
# nox step: on GitHub they are written to $GITHUB_ENV. Run by hand, do the same
# in your shell:
#   source /usr/local/Ascend/ascend-toolkit/set_env.sh
#   export TORCH_DEVICE_BACKEND_AUTOLOAD=0
set -euo pipefail

PYTHON=${PYTHON:-python}
# torch-npu X.Y pairs with torch X.Y; torch comes from the CPU-only index
# (the PyPI Linux x86 build is the CUDA one).
TORCH_SERIES=${GRAPHRT_NPU_TORCH_SERIES:-2.11}
TORCH_INDEX_URL=${GRAPHRT_TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
ASCEND_ENV=${ASCEND_ENV:-/usr/local/Ascend/ascend-toolkit/set_env.sh}

# Writes every variable whose value changed since `snapshot_env` to $GITHUB_ENV.
declare -A env_before=()
snapshot_env() {
    local kv
    while IFS= read -r -d '' kv; do env_before[${kv%%=*}]=${kv#*=}; done < <(env -0)
}
persist_changed_env() {
    [[ -n ${GITHUB_ENV:-} ]] || return 0
    local kv key value
    while IFS= read -r -d '' kv; do
        key=${kv%%=*} value=${kv#*=}
        if [[ ${env_before[$key]-} != "$value" && $value != *$'\n'* ]]; then
            echo "$key=$value" >>"$GITHUB_ENV"
        fi
    done < <(env -0)
}

snapshot_env
# torch_npu's auto-load makes `import torch` fail without the toolkit;
# graphrt imports torch_npu itself when the NPU is selected.
export TORCH_DEVICE_BACKEND_AUTOLOAD=0
if [[ -f $ASCEND_ENV ]]; then
    set +u  # the toolkit's script reads variables that may be unset
    # shellcheck disable=SC1090
    source "$ASCEND_ENV"
    set -u
else
    echo "npu lane: $ASCEND_ENV not found; torch_npu will not find the CANN toolkit" >&2
fi
persist_changed_env

if command -v npu-smi >/dev/null; then npu-smi info; fi

"$PYTHON" -m pip install "torch==${TORCH_SERIES}.*" --index-url "$TORCH_INDEX_URL"
"$PYTHON" -m pip install "torch-npu==${TORCH_SERIES}.*" nox
