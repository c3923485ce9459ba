#!/usr/bin/env bash
# research/gpu_check.sh: proves the GPU path in one call of at most 10 minutes (docs/results.md,
# "The GPU check"). Each part is `python research/gpu_check.py PART` in a process of its own, under
# its own time limit, so one that hangs cannot eat the others' time. Each prints ONE line:
#   ok   PART: its figures
#   FAIL PART (exit N, or: past its time limit of S s), then the part's last lines
# The parts: the CUDA tests; flex against the gather kernel at 10 lengths, with its compile count;
# a bf16 fully masked row; the demo, shortened (examples/s, peak memory); --compile with HST;
# resume (CPU: bit-identical; CUDA: the step reached, the weights' relative difference); predict
# on CUDA against the CPU; the bench's GPU figures (MFU, sparse against dense at 16k).
#   bash research/gpu_check.sh [REPORT]          # on the GPU machine; REPORT: $OUT/gpu_check.md
#   bash research/gpu_check.sh --cpu [REPORT]    # the rehearsal on the CPU (the suite runs it)
# Exit status: 0 when every part is ok, 1 otherwise.
set -u
cd "$(dirname "$0")/.."
device=cuda
if [ "${1:-}" = "--cpu" ]; then
  device=cpu
  shift
fi
report=${1:-${OUT:-.}/gpu_check.md}
mkdir -p "$(dirname "$report")"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
: > "$report"
say() { echo "$@" | tee -a "$report"; }

# The parts, in order (predict reads the demo's checkpoint), each with its time limit in seconds.
# The limits add up to 560 s: with Python's starts the whole call stays under 10 minutes.
parts="tests:100 flex:60 bf16-row:20 demo:80 compile:90 resume:60 predict:40 bench:110"

say "# gpu_check on $device, $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD)"
python -c "import torch; print('torch', torch.__version__, '| CUDA', torch.version.cuda, '|',
  torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')" \
  | tee -a "$report"
failed=0
for entry in $parts; do
  name=${entry%%:*}
  limit=${entry##*:}
  t0=$SECONDS
  timeout "$limit" python research/gpu_check.py "$name" --device "$device" --work "$work" \
    > "$work/$name.txt" 2>&1
  rc=$?
  took=$((SECONDS - t0))
  line=$(grep "^ok $name: " "$work/$name.txt" | tail -n 1)
  if [ $rc = 0 ] && [ -n "$line" ]; then
    say "$line ($took s)"
  else
    failed=1
    why="exit $rc"
    [ $rc = 124 ] && why="past its time limit of $limit s"
    say "FAIL $name ($why, $took s); its last lines:"
    tail -n 15 "$work/$name.txt" | sed 's/^/    /' | tee -a "$report"
  fi
done
say "$([ $failed = 0 ] && echo 'every part ok' || echo 'some parts FAILED') in $SECONDS s"
exit $failed
