#!/usr/bin/env bash
# A whole GPU check within BUDGET seconds (default 690: a lease's 15 minutes less the
# carrying of the bundle), in the call that carries the bundle's last part into /tmp/bundle.
# Cheapest first; a step that no longer fits is cut, and said to be:
#   install   the bundle into /tmp/site
#   parity    eager on both sides (vLLM's --enforce-eager: engines start in seconds of
#             loading): every mode of MODES on the tiny model of each of FAMILIES (Qwen2-VL
#             and LLaVA) beside one offline engine each (scripts/gpu-host/parity.py); the
#             mesh engines' KV cache KV_BYTES bytes (default 2 GiB on a GPU; empty: sized
#             by vLLM's profiling), so that the engines sharing the GPU start together
#   parity-2b the same on the qwen2-vl-2b preset in bfloat16, MODES_2B
#   start     an E/P/D mesh's start, stage by stage: eager, compiled from an empty cache,
#             compiled again from that cache (bench/start.py)
#   serve     CUDA graphs on: `vllm serve` and every mode at concurrency 1 and 32 on the tiny
#             Qwen2-VL (verify-gpu's serve step; parity was the step above)
# STEPS picks some (default: all, in that order; on the CPU all but install and parity-2b). Every step runs in a session of its own;
# when it ends, or its time is up, each process left in that session (a mesh's stages, vLLM's
# engine cores, the offline engine) is stopped by its process id. A call returns only a few
# files, so everything lands in one archive, $OUT/lease.tgz.
#
# FORM=cpu: the same on this machine's CPU, from .venv and without installing, the tiny
# models only (`tests/e2e/test_gpu_lease.py` runs it, so that the script is proven before a
# GPU is lent).
set -u
: "${OUT:?}"
BUDGET=${BUDGET:-690}
FORM=${FORM:-gpu}
if [ "$FORM" = cpu ]; then STEPS=${STEPS:-parity,start,serve}; else STEPS=${STEPS:-install,parity,parity-2b,start,serve}; fi
if [ "$FORM" = cpu ]; then KV_BYTES=${KV_BYTES-}; else KV_BYTES=${KV_BYTES-2147483648}; fi
MODES=${MODES:-epd,e/pd,e/p/d,ep/d}
FAMILIES=${FAMILIES:-qwen2-vl llava}
MODES_2B=${MODES_2B:-e/pd,e/p/d}
begin=$(date +%s)
left() { echo $((BUDGET - $(date +%s) + begin - ${1:-0})); }
at() { echo "$* after $(($(date +%s) - begin)) s"; }
work=${WORK:-/tmp/lease}
models=${MODELS:-/tmp}
mkdir -p "$work"
: >"$work/steps.tsv"
trap 'tar czf "$OUT/lease.tgz" -C "$work" . 2>/dev/null' EXIT
wanted() { case ",$STEPS," in *",$1,"*) return 0 ;; esac; return 1; }

# run NAME SECONDS COMMAND...: COMMAND in a session of its own for at most SECONDS (SIGTERM,
# then each process left in the session SIGKILLed by its id), logged to $work/NAME.log and
# recorded in steps.tsv; a step with under 30 s left is cut.
run() {
  local name=$1 limit=$2 start status sid survivors
  shift 2
  if [ "$limit" -lt 30 ]; then
    printf '%s\tcut\t0\t%s\n' "$name" "$*" >>"$work/steps.tsv"
    at "cut $name ($limit s left)"
    return 0
  fi
  start=$(date +%s)
  # A background job of a script is no group leader, so setsid makes it a session's leader
  # without forking: its process id is the session's.
  setsid "$@" >"$work/$name.log" 2>&1 &
  sid=$!
  # Polled here rather than by a timer in the background, which would hold this script's
  # output open after it ends. SIGTERM at the limit, SIGKILL 20 s later.
  while kill -0 "$sid" 2>/dev/null; do
    [ "$(date +%s)" -ge $((start + limit)) ] && kill -TERM "$sid" 2>/dev/null
    [ "$(date +%s)" -ge $((start + limit + 20)) ] && kill -KILL "$sid" 2>/dev/null
    sleep 1
  done
  wait "$sid"
  status=$?
  for _ in 1 2 3 4 5 6 7 8 9 10; do
    survivors=$(ps -eo pid=,sid= | awk -v s="$sid" '$2 == s {print $1}')
    [ -z "$survivors" ] && break
    sleep 1
  done
  # shellcheck disable=SC2086 # one id per word
  [ -n "$survivors" ] && kill -KILL $survivors 2>/dev/null
  printf '%s\t%d\t%d\t%s\n' "$name" "$status" $(($(date +%s) - start)) "$*" >>"$work/steps.tsv"
  at "$name ended (exit $status)"
  return "$status"
}

if [ "$FORM" = cpu ]; then
  PY=${PY:-.venv/bin/python}
else
  PY=python3
  if wanted install; then
    run install "$(left)" scripts/install_offline.sh /tmp/bundle /tmp/site || { tail -30 "$work/install.log"; exit 1; }
  fi
  export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH VLLM_USE_FLASHINFER_SAMPLER=0
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$work/nvidia-smi.txt" 2>&1
fi
export HF_HUB_OFFLINE=1 PY

# The tiny models: in MODELS already, carried with the last part (models/, 4 MB each), or
# built here (20 s each).
tiny=()
for family in $FAMILIES; do
  tiny+=(--model "$family=$models/tiny-$family")
  if [ -f "$models/tiny-$family/config.json" ]; then
    continue
  elif [ -f "models/tiny-$family/config.json" ]; then
    cp -r "models/tiny-$family" "$models/tiny-$family"
  else
    "$PY" -m prism.cli model build --family "$family" --out "$models/tiny-$family" >"$work/model-$family.log" 2>&1
  fi
done
if [ "$FORM" != cpu ] && wanted parity-2b; then
  # Built meanwhile (about 35 s of CPU), and stopped by its id if it is not needed.
  setsid "$PY" -m prism.cli model build --preset qwen2-vl-2b --out "$models/qwen2-vl-2b" >"$work/model-2b.log" 2>&1 &
  build=$!
fi
[ -f docs/gpu.md ] && cp docs/gpu.md "$work/gpu.md"
failed=0
if wanted parity; then
  run parity "$(left)" "$PY" scripts/gpu-host/parity.py "$work/parity" --eager --budget "$(left 40)" \
    --kv-cache-bytes "${KV_BYTES:-0}" --modes "$MODES" "${tiny[@]}" || failed=1
  grep -E 'prompts equal|^cut|NOT EQUAL' "$work/parity.log"
fi
if wanted parity-2b; then
  wait "${build:-0}" 2>/dev/null
  run parity-2b "$(left)" "$PY" scripts/gpu-host/parity.py "$work/parity-2b" --eager --budget "$(left 40)" \
    --kv-cache-bytes "${KV_BYTES:-0}" --expect "$work/parity/parity.json" --modes "$MODES_2B" \
    --model "qwen2-vl-2b=$models/qwen2-vl-2b" || failed=1
  grep -E 'prompts equal|^cut|NOT EQUAL' "$work/parity-2b.log"
fi
[ -n "${build:-}" ] && kill -KILL -- "-$build" 2>/dev/null
if wanted start; then
  run start "$(left)" "$PY" -m bench.start --model "$models/tiny-qwen2-vl" --out "$work/start.json" || failed=1
  grep -E 'ready in' "$work/start.log"
fi
if wanted serve; then
  run serve "$(left)" env PARITY= RESULTS="$work/serve" MODEL="$models/tiny-qwen2-vl" STEPS=serve \
    MODES="$MODES" REQUESTS="${REQUESTS:-16}" DOC="$work/gpu.md" FORM="$FORM" scripts/verify_gpu.sh || failed=1
  grep -E 'req/s|skipped|failed' "$work/serve/serve.log" 2>/dev/null | tail -20
fi
at "done (failed: $failed)"
exit "$failed"
