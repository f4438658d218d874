#!/usr/bin/env bash
# SpaceServe GPU harness: every GPU check in one script, from the source tree (nothing installed).
#   bash bench/gpu/run.sh --out OUTDIR        (on the GPU machine; at most 9 minutes, exits 0)
#   bash bench/gpu/run.sh --dry-run OUTDIR    (the same control flow on CPU, about a minute)
#   bash bench/gpu/run.sh [RESULTS_DIR] [--only SECTION ...] [--budget SECTION=S] [--list]
# OUTDIR receives results.tar.gz, summary.json and harness.log, refreshed after every section;
# the full results stay in RESULTS_DIR (default bench/results/<date>-<gpu>/).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
# 10+ streams (two per partition, uploads, graphs) would otherwise share 8 hardware queues and
# serialise behind each other: give each its own (CUDA reads this when the context is made).
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
export TRITON_DEFAULT_FP_FUSION="${TRITON_DEFAULT_FP_FUSION:-1}"
PYTHON="${PYTHON:-python3}"
exec "$PYTHON" -m bench.gpu.harness "$@"
