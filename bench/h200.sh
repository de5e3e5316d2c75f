#!/usr/bin/env bash
# The GPU suite: CUDA tests, the paper's latency protocol and FSDP2 training, figures to OUT/h200.{json,md}.
#   bash bench/h200.sh [OUT]             on a CUDA machine, < 10 minutes, nothing downloaded
#   bash bench/h200.sh --dry-run [OUT]   the same steps on CPU at tiny sizes (CI)
set -uo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" bench/h200.py "$@"   # PYTHON: the interpreter with torch (default: python on PATH)
