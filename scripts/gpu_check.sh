#!/usr/bin/env bash
# The GPU checks of ft-lightning, as one prepared run (docs/gpu.md). Run from the repository root in an
# environment that already has a CUDA build of torch:
#     bash scripts/gpu_check.sh            # or: bash scripts/gpu_check.sh --no-install
# It installs nothing but this package (`pip install -e '.[test]'`), prints the GPUs, torch, CUDA and
# NCCL versions, runs every CUDA test with the reason of each skip (-rs), and ends with a summary.
# Exit status: 0 when every CUDA test passed or skipped for want of GPUs, 1 otherwise.
set -u -o pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" != "--no-install" ]; then
    python -m pip install -q -e '.[test]' || { echo "gpu_check: pip install -e '.[test]' failed"; exit 1; }
fi

python - <<'PY' || { echo "gpu_check: this torch has no CUDA device; nothing to check"; exit 1; }
import torch
if not torch.cuda.is_available():
    raise SystemExit(1)
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {torch.cuda.nccl.version()}, "
      f"{torch.cuda.device_count()} GPU(s):")
for i in range(torch.cuda.device_count()):
    print(f"  cuda:{i}  {torch.cuda.get_device_name(i)}")
PY

LOG="${GPU_CHECK_LOG:-gpu_check.log}"
: > "$LOG"
# 1. The stream-order, staging and device tests, the NCCL/BabyNCCL groups, the HTTP transport's CUDA staging.
python -m pytest -rfEs -q -p no:cacheprovider \
    tests/test_cuda_paths.py \
    tests/test_process_group_cuda.py \
    "tests/test_http_transport.py::test_cuda_tensors_are_staged_to_pinned_host_memory" \
    2>&1 | tee -a "$LOG"
first=${PIPESTATUS[0]}
# 2. Every other test marked `cuda` (the Lightning/Fabric/Accelerate CUDA runs).
python -m pytest -rfEs -q -p no:cacheprovider -m cuda tests \
    --deselect tests/test_cuda_paths.py --deselect tests/test_process_group_cuda.py \
    2>&1 | tee -a "$LOG"
second=${PIPESTATUS[0]}

echo
echo "==== gpu_check summary (full output: $LOG) ===="
grep -E "^(FAILED|ERROR|SKIPPED)|[0-9]+ (passed|failed|skipped|errors?|deselected)" "$LOG" | tail -n 60
ok() { [ "$1" -eq 0 ] || [ "$1" -eq 5 ]; }  # 5: nothing collected (no test marked cuda left)
if ok "$first" && ok "$second"; then
    echo "gpu_check: OK (pytest exits $first, $second)"
    exit 0
fi
echo "gpu_check: FAILED (pytest exits $first, $second)"
exit 1
