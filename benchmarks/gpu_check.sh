#!/usr/bin/env bash
# GPU checks: the CUDA code paths (tests/gpu; the NCCL checks too with >= 2 GPUs) and the
# AMP / memory benchmarks on CUDA at a size where the GPU is compute-bound (d_model 1024).
#
#   bash benchmarks/gpu_check.sh              # results in gpu_check/ (or $GPU_CHECK_OUT)
#
# Writes gpu_tests.txt, amp.txt/amp.json, memory.txt/memory.json. The benchmark tables
# start with the environment, TF32 and cuDNN settings included. Exit status: non-zero
# when a test fails or a benchmark cannot run.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${GPU_CHECK_OUT:-gpu_check}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TQDM_DISABLE=1

python - <<'PY'
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
if n < 2:
    print("one GPU: the multi-GPU tests (NCCL, a model over two GPUs) will be skipped")
PY

status=0
echo "== tests/gpu"
python -m pytest -q -p no:cacheprovider -rs tests/gpu 2>&1 | tee "$out/gpu_tests.txt" || status=1

# A transformer of width 1024 (16 heads, 8 blocks, 512 tokens, batch 8): matmuls large
# enough that the GPU, not the Python overhead, sets the pace.
size=(--model transformer --d-model 1024 --heads 16 --layers 8 --seq-len 512 --batch-size 8)
echo "== python -m ftrain.bench amp --device cuda ${size[*]}"
python -m ftrain.bench amp --device cuda "${size[@]}" --no-progress --json "$out/amp.json" \
    2>&1 | tee "$out/amp.txt" || status=1
echo "== python -m ftrain.bench memory --device cuda ${size[*]}"
python -m ftrain.bench memory --device cuda "${size[@]}" --no-progress --json "$out/memory.json" \
    2>&1 | tee "$out/memory.txt" || status=1

echo "results in $out/ (status $status)"
exit "$status"
