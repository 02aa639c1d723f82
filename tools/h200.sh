#!/usr/bin/env bash
# Runs on the H200 machine from the repository root (device tool). Phases:
#   test [args]    GPU test suite (WORKERS=4 xdist workers where pytest-xdist is installed; 1: serial)
#   verify [args]  trainnorm verify
#   ledger         test (both passes), then verify --quick: what a line of docs/reliability/gpu-runs.md needs
#   bits OLD_SRC   trainnorm.dev.bits here and against another checkout's src/ (both at once), then compared
#   bench [args]   trainnorm bench (peers on PYTHONPATH if peer-env.sh b was sourced)
#   part [args]    trainnorm bench over the rows the earlier parts on this (warm) machine left
#                  (a bench longer than one call: LIMIT=540 bash tools/h200.sh part --jobs 14 --set default,beyond,block)
#   tune [args]    python -m trainnorm.dev.tune (e.g. --sweep-bwd; the table lands in $OUT/tune/)
#   soak [args]    python -m trainnorm.dev.soak (e.g. --cases 10000 --workers 8 --time-limit 480)
#   compile [args] python -m trainnorm.dev.compile_check (registers and spills per kernel form)
#   sanitize [tools]  tools/sanitize.sh (memcheck racecheck ...)
# Each phase logs and writes under $OUT/<phase>/ and packs that into $OUT/<phase>.tgz
# (the device returns at most 8 files).
set -uo pipefail
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
phase="$1"; shift
d="$OUT/$phase"; mkdir -p "$d"
case "$phase" in
  test)   # WORKERS pytest-xdist workers share the GPU for all but the bigmem tests, which then
          # run alone, one after another (tests/conftest.py). The suite sees src/ alone: with the
          # bench's peers on the path (peer-env.sh b), transformers' Qwen3-Next ran fla's gated
          # delta rule on the CPU model of tests/test_integrations.py, and Triton refused the
          # CPU tensors (the run of 2026-12-06 at 99e8565)
          export PYTHONPATH="$PWD/src"
          par=(); python3 -c "import xdist" 2>/dev/null && [ "${WORKERS:-4}" -gt 1 ] && par=(-n "${WORKERS:-4}")
          # both passes run whatever the first gives; their summaries are repeated at the end
          { timeout "${LIMIT:-480}" python3 -m pytest -q "${par[@]}" -m "not bigmem" tests "$@"
            echo "pass 1 (not bigmem): exit $?"
            timeout "${LIMIT:-480}" python3 -m pytest -q -p no:xdist -m bigmem tests "$@"
            echo "pass 2 (bigmem): exit $?"; } 2>&1 | tee "$d/log" | tail -40
          grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed)|^pass [12] " "$d/log" | tail -30 ;;
  ledger) # the counts are in test.tgz's log (the test phase reports passes, not an exit status)
          WORKERS="${WORKERS:-6}" LIMIT="${LIMIT:-300}" bash "$0" test
          LIMIT="${VLIMIT:-180}" bash "$0" verify --quick 2>&1 | tee "$d/log" | tail -3 ;;
  verify) timeout "${LIMIT:-480}" python3 -m trainnorm verify --out "$d" "$@" 2>&1 | tee "$d/log" | tail -60 ;;
  bits)   # alone on the GPU: both sides ran past 250 s beside the suite on an H100 and past 300 s alone on
          # an H200 while the outputs were hashed on the host (bits.py now fingerprints them on the GPU)
          { PYTHONPATH="$1" timeout "${LIMIT:-480}" python3 src/trainnorm/dev/bits.py --out "$d/old.json" > "$d/old.log" 2>&1 &
            timeout "${LIMIT:-480}" python3 -m trainnorm.dev.bits --out "$d/new.json" > "$d/new.log" 2>&1; wait
            python3 -m trainnorm.dev.bits --compare "$d/old.json" "$d/new.json"; } 2>&1 | tee "$d/log" | tail -40 ;;
  bench)  timeout "${LIMIT:-480}" python3 -m trainnorm bench --out "$d" "$@" 2>&1 | tee "$d/log" | tail -80 ;;
  part)   # one part of a bench longer than a call: the rows no earlier part on this machine
          # measured (their bench.json kept in $TMPDIR/bench-parts while the machine stays warm),
          # this part's kept there in turn; `trainnorm bench --merge` joins the parts' files here
          keep="${TMPDIR:-/tmp}/bench-parts"; mkdir -p "$keep"; done_=("$keep"/*.json)
          skip=(); [ -e "${done_[0]}" ] && skip=(--skip-done "${done_[@]}")
          timeout "${LIMIT:-480}" python3 -m trainnorm bench --out "$d" "${skip[@]}" "$@" 2>&1 | tee "$d/log" | tail -20
          [ -f "$d/bench.json" ] && cp "$d/bench.json" "$keep/part$(ls "$keep" | wc -l).json"
          echo "parts kept on this machine: $(ls "$keep" | tr '\n' ' ')" ;;
  tune)   timeout "${LIMIT:-480}" python3 -m trainnorm.dev.tune --out "$d" "$@" 2>&1 | tee "$d/log" | tail -80 ;;
  soak)   timeout "${LIMIT:-540}" python3 -m trainnorm.dev.soak --out "$d" "$@" 2>&1 | tee "$d/log" | tail -40 ;;
  compile) timeout "${LIMIT:-540}" python3 -m trainnorm.dev.compile_check "$@" 2>&1 | tee "$d/log" | tail -40 ;;
  sanitize) timeout "${LIMIT:-540}" bash tools/sanitize.sh "$d" "$@" 2>&1 | tee "$d/log" | tail -20 ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
rc=${PIPESTATUS[0]}
tar czf "$OUT/$phase.tgz" -C "$OUT" "$phase" && rm -rf "$d"
exit $rc
