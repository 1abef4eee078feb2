#!/usr/bin/env bash
# GPU checks that decide (issue 20.11): one table (check, measured, target, verdict), exit
# status non-zero when a check misses its target. About 10 minutes on one H100.
#
#   bash benchmarks/gpu_check.sh              # every check
#   bash benchmarks/gpu_check.sh --only G3 G7 # some of them (see benchmarks/gpu_check.py)
#
# The table is also written to gpu_check/table.txt (or $GPU_CHECK_OUT).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${GPU_CHECK_OUT:-gpu_check}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TQDM_DISABLE=1
PY="${PYTHON:-python}"

"$PY" - <<'PY'
import sys

import torch

if not torch.cuda.is_available():
    sys.exit(
        f"gpu_check.sh: no CUDA device is visible (torch {torch.__version__}, CUDA build "
        f"{torch.version.cuda}); run it on a GPU machine with a CUDA build of torch."
    )
n = torch.cuda.device_count()
names = ", ".join(torch.cuda.get_device_name(i) for i in range(n))
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {n} GPU(s): {names}")
PY

mkdir -p "$out"
status=0
"$PY" benchmarks/gpu_check.py "$@" | tee "$out/table.txt" || status=$?
echo "table in $out/table.txt (status $status)"
exit "$status"
