#!/usr/bin/env bash
# SpaceServe GPU harness: every GPU check in one script, from the source tree (nothing installed).
#   bash bench/gpu/run.sh [RESULTS_DIR] [--only SECTION ...] [--list] [--total-s SECONDS]
# Writes JSON, PNGs and per-section logs to RESULTS_DIR (default bench/results/<date>-<gpu>/) and
# prints a summary table last. Each section runs in its own process under its own time budget.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
export TRITON_DEFAULT_FP_FUSION="${TRITON_DEFAULT_FP_FUSION:-1}"
PYTHON="${PYTHON:-python3}"
exec "$PYTHON" -m bench.gpu.harness "$@"
