#!/usr/bin/env bash
# Runs the given tests N times in a row, each run in a fresh pytest, and says how many
# passed. With LOAD=1 a CPU burner per core runs all the while (a loaded machine).
# Logs: $OUT (default /tmp/prism-repeat)/run-K.log, and a failed run's mesh logs beside it.
#   scripts/repeat.sh 20 tests/e2e/test_worker_loss.py
#   LOAD=1 scripts/repeat.sh 20 tests/e2e/test_worker_loss.py::test_a_worker_killed_mid_stream_hands_the_request_to_another
set -uo pipefail
cd "$(dirname "$0")/.."
runs=$1
shift
out=${OUT:-/tmp/prism-repeat}
mkdir -p "$out"
burners=()
if [ "${LOAD:-0}" = 1 ]; then
  for _ in $(seq "$(nproc)"); do
    python3 -c 'while True: pass' &
    burners+=($!)
  done
fi
trap '[ ${#burners[@]} -gt 0 ] && kill "${burners[@]}" 2>/dev/null' EXIT
passed=0
for k in $(seq "$runs"); do
  if .venv/bin/python -m pytest -q -p no:cacheprovider --basetemp="$out/tmp-$k" "$@" >"$out/run-$k.log" 2>&1; then
    passed=$((passed + 1))
    echo "run $k: passed"
    rm -rf "$out/tmp-$k"
  else
    echo "run $k: FAILED (see $out/run-$k.log and the mesh logs under $out/tmp-$k)"
  fi
done
echo "$passed of $runs runs passed${LOAD:+ (LOAD=$LOAD)}"
[ "$passed" = "$runs" ]
