#!/usr/bin/env bash
# Runs GPU tests with small and medium shapes under compute-sanitizer, one run per tool.
#
#   tools/sanitize.sh LOGDIR [TOOL ...]       TOOL: memcheck racecheck initcheck synccheck
#                                             (default: memcheck racecheck)
#   SANITIZE_TESTS="tests/test_gpu_sanitize.py tests/test_kernels.py" tools/sanitize.sh logs
#   SANITIZE_K="forms or gated" tools/sanitize.sh logs memcheck   # a pytest -k expression
#
# Default selection: tests/test_gpu_sanitize.py (every kernel form: forward with and
# without residual / gate, column tiles; backward dw forms none / partial / atomic /
# direct, wide rows, two-level strides, combine kernel). The PyTorch caching
# allocator is turned off (PYTORCH_NO_CUDA_MEMORY_CACHING=1) so that every tensor is
# its own allocation and an out-of-bounds access is not hidden inside a pooled block.
# Logs: LOGDIR/<tool>-pytest.txt (pytest's output) and LOGDIR/<tool>.<pid>.log (the
# sanitizer's report per process). Prints one line per tool; exits 1 if any failed.
set -uo pipefail
if [ $# -lt 1 ]; then
  echo "usage: $0 LOGDIR [memcheck|racecheck|initcheck|synccheck ...]" >&2
  exit 2
fi
logdir="$1"; shift
tools=("$@")
[ ${#tools[@]} -eq 0 ] && tools=(memcheck racecheck)
mkdir -p "$logdir"
cd "$(dirname "$0")/.."

cs="$(command -v compute-sanitizer || true)"
[ -z "$cs" ] && [ -x /usr/local/cuda/bin/compute-sanitizer ] && cs=/usr/local/cuda/bin/compute-sanitizer
if [ -z "$cs" ]; then
  echo "compute-sanitizer not found (PATH or /usr/local/cuda/bin)" >&2
  exit 2
fi
py="${PYTHON:-python3}"
tests=(${SANITIZE_TESTS:-tests/test_gpu_sanitize.py})
kexpr=()
[ -n "${SANITIZE_K:-}" ] && kexpr=(-k "$SANITIZE_K")

export PYTORCH_NO_CUDA_MEMORY_CACHING=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

status=0
summary=()
for tool in "${tools[@]}"; do
  extra=()
  case "$tool" in
    memcheck)  extra=(--check-device-heap yes) ;;
    racecheck) extra=(--racecheck-report all) ;;
    initcheck|synccheck) ;;
    *) echo "unknown tool $tool" >&2; exit 2 ;;
  esac
  rm -f "$logdir/$tool".*.log
  t0=$(date +%s)
  "$cs" --tool "$tool" --error-exitcode 1 --target-processes all "${extra[@]}" \
        --log-file "$logdir/$tool.%p.log" \
        "$py" -m pytest -q -p no:cacheprovider "${tests[@]}" "${kexpr[@]}" >"$logdir/$tool-pytest.txt" 2>&1
  rc=$?
  secs=$(( $(date +%s) - t0 ))
  # "ERROR SUMMARY: N errors" (memcheck, initcheck, synccheck) / "RACECHECK SUMMARY: N hazards"
  errors=$(cat "$logdir/$tool".*.log 2>/dev/null \
           | grep -Eo '(ERROR SUMMARY: [0-9]+ error|RACECHECK SUMMARY: [0-9]+ hazard)' \
           | grep -Eo '[0-9]+' | awk '{s += $1} END {print s + 0}')
  result=$(tail -n 1 "$logdir/$tool-pytest.txt" | tr -s ' ')
  if [ "$rc" -eq 0 ] && [ "$errors" -eq 0 ]; then verdict=PASS; else verdict=FAIL; status=1; fi
  summary+=("$tool: $verdict (exit $rc, $errors sanitizer errors/hazards, ${secs} s; pytest: $result)")
done
for line in "${summary[@]}"; do echo "$line"; done | tee "$logdir/summary.txt"
exit $status
