#!/usr/bin/env bash
# research/gpu_check.sh: everything this project wants from a lent GPU (one H200), in one go, under 8 minutes:
#   1. the CUDA-only tests (FlexAttention gradients vs the gather kernel, bf16 steps) and the CPU-side
#      precision / device / Flex tests, on this machine;
#   2. the demo (`python train.py`: ListOps, HST + SAR + AttendOut) on the GPU, with its wall time;
#   3. `python research/bench.py --device cuda --only throughput`: bf16 tokens/s and MFU at 4k and 16k for
#      dense SDPA, sparse through FlexAttention and (with attention dropout) through the gather kernel, and HST.
# All figures go to ONE file: the first argument, else $OUT/gpu_check.md (the device tool's folder), else
# ./gpu_check.md. Each part has its own time limit, so one that hangs cannot eat the others' time.
#   bash research/gpu_check.sh [FILE]            # on the GPU machine
#   bash research/gpu_check.sh FILE --dry-run    # on a CPU: the same steps, tiny (checks the script itself)
set -u
cd "$(dirname "$0")/.."
report=${1:-${OUT:-.}/gpu_check.md}
dry=${2:-}
mkdir -p "$(dirname "$report")"
work=$(mktemp -d)
: > "$report"
say() { echo "$@" | tee -a "$report"; }

# part NAME LIMIT_S COMMAND...: run with a time limit, keep the tail of its output in the report
part() {
  local name=$1 limit=$2; shift 2
  say ""; say "## $name"; say ""; say '```'
  local t0=$SECONDS
  timeout "$limit" "$@" > "$work/out.txt" 2>&1
  local rc=$?
  tail -n 60 "$work/out.txt" | tee -a "$report"
  say '```'
  say "exit $rc$([ $rc = 124 ] && echo ' (time limit)'), $((SECONDS - t0)) s"
}

say "# gpu_check $(date -u '+%Y-%m-%d %H:%M UTC')"
say ""
python - <<'PY' 2>&1 | tee -a "$report"
import torch
print("torch", torch.__version__, "| CUDA", torch.version.cuda, "|",
      torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA DEVICE")
PY
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee -a "$report"

if [ "$dry" = "--dry-run" ]; then          # CPU: the same three parts, tiny
  part "tests (dry run)" 300 python -m pytest -q -x tests/test_cuda.py tests/test_flex.py
  part "demo (dry run: 2 steps on the CPU)" 300 python train.py --out "$work/demo" --max-steps 2 --device cpu
  part "bench (dry run: --quick, CPU)" 300 \
    python research/bench.py --quick --only throughput,hst --rounds 1 --json "$work/bench.json"
  exit 0
fi

# 1. tests: the CUDA ones, then the CPU-side ones that guard the CUDA path (about a minute)
part "tests: CUDA-only, Flex, precision, devices" 150 \
  python -m pytest -q -x tests/test_cuda.py tests/test_flex.py tests/test_precision.py tests/test_devices.py

# 2. the demo: `python train.py` (every default is the demo's), in a scratch run folder
part "demo: python train.py on the GPU" 150 bash -c "time python train.py --out $work/demo"
[ -f "$work/demo/final.json" ] && { say ""; say "final.json:"; cat "$work/demo/final.json" | tee -a "$report"; }

# 3. throughput, bf16: dense / sparse (Flex) / sparse (gather) / HST at 4k and 16k, one fresh process each
part "bench: python research/bench.py --device cuda --only throughput" 240 \
  python research/bench.py --device cuda --only throughput --json "${OUT:-$work}/bench_cuda.json"
say ""
say "done in $SECONDS s"
