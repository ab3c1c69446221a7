#!/usr/bin/env bash
# Intel GPU lane: torch from PyTorch's XPU index, then nox (which runs
# `nox -s tests-xpu`; its venv sees this XPU torch through the system
# site-packages and keeps it).
set -euo pipefail

PYTHON=${PYTHON:-python}
TORCH_SPEC=${GRAPHRT_TORCH_SPEC:-torch>=2.11,<2.15}  # pyproject's range
TORCH_INDEX_URL=${GRAPHRT_TORCH_INDEX_URL:-https://download.pytorch.org/whl/xpu}

if command -v xpu-smi >/dev/null; then xpu-smi discovery; fi

"$PYTHON" -m pip install "$TORCH_SPEC" --index-url "$TORCH_INDEX_URL"
"$PYTHON" -m pip install nox
"$PYTHON" -c "import torch; print('torch', torch.__version__, 'xpu available:', torch.xpu.is_available())"
