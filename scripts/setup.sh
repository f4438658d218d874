#!/usr/bin/env bash
# Create (or reuse) .venv and install SpaceServe into it for development: `pip install -e .[dev]`.
# The venv sees the system's site-packages, so a CUDA build of torch already installed is kept;
# torch 2.13.0 is installed only when no torch can be imported. Override it with
# SPACESERVE_TORCH (a pip requirement) and SPACESERVE_TORCH_INDEX (a pip index URL, e.g. PyTorch's
# CPU wheel index on a machine whose default torch would be a CUDA build).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PY" -m venv --system-site-packages .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check)
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  echo "setup: no torch found; installing ${SPACESERVE_TORCH:-torch==2.13.0}"
  "${PIP[@]}" install --quiet ${SPACESERVE_TORCH_INDEX:+--index-url "$SPACESERVE_TORCH_INDEX"} \
    "${SPACESERVE_TORCH:-torch==2.13.0}"
fi
echo "setup: pip install -e .[dev]"
"${PIP[@]}" install --quiet -e ".[dev]"
.venv/bin/python -c "import torch, triton; print(f'setup: torch {torch.__version__}, triton ' \
f'{triton.__version__}, CUDA available: {torch.cuda.is_available()}')"
# the server and its tests (the `serve` extra, also in `dev`)
.venv/bin/python -c "import fastapi, uvicorn, httpx, openai, PIL; \
print(f'setup: fastapi {fastapi.__version__}, uvicorn {uvicorn.__version__}, openai {openai.__version__}')"
