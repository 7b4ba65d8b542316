#!/usr/bin/env bash
# Verifies Prism's GPU path on this machine, in one go (make verify-gpu), and writes every
# figure with the command that produced it to RESULTS and to DOC's section for this device:
#   1. smoke: versions; vLLM's kernels against torch on the device; a NIXL pool in its memory
#   2. the model: the qwen2-vl-2b preset (random weights, the published architecture)
#   3. serving: E/PD and E/P/D answer as one offline vLLM engine, token for token (greedy,
#      4 image prompts, 16 tokens); then EPD, E/PD and E/P/D beside `vllm serve` at
#      concurrency 1 and 32, one server at a time (E/P/D's engines share the one GPU)
#   4. NIXL: 8 MiB of embeddings read between two processes, device memory on both sides
#   5. the encoder's images/s at 32 concurrent one-image requests, batched and not
# Without a GPU, the same steps in their CPU form: the tiny Qwen2-VL, device cpu, E/P/D
# alone beside `vllm serve`, fewer requests (a test runs it so that the script is proven on
# every CI run).
#
# Environment: FORM=auto|gpu|cpu, PY (default .venv/bin/python, else python3 with Prism on
# PYTHONPATH, as the offline bundle installs it), MODEL (a checkpoint to use instead),
# RESULTS (default bench/results/verify-FORM), DOC (default docs/gpu.md), STEPS (some of
# smoke,serve,encoder,transfer: to spread the run over calls of a machine that allows only
# so many minutes each; the report takes each step's latest run from RESULTS), and MODES,
# PARITY and REQUESTS (the Prism modes served, those of them checked against offline
# vLLM, set but empty for none, the requests per concurrency level: a short lease's serve
# step, e.g. MODES=e/pd,e/p/d REQUESTS=16).
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export HF_HUB_OFFLINE=1
# flashinfer's sampler compiles and downloads kernels at run time; GPU hosts may be offline.
export VLLM_USE_FLASHINFER_SAMPLER=0
FORM=${FORM:-auto}
if [ "$FORM" = auto ]; then
  if "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then FORM=gpu; else FORM=cpu; fi
fi
if [ "$FORM" = gpu ]; then
  DEVICE=cuda BUILD=(--preset qwen2-vl-2b) MODEL=${MODEL:-models/qwen2-vl-2b}
  REQUESTS=${REQUESTS:-64} ENCODER_REQUESTS=256 ROUNDS=3
  MODES=${MODES:-epd,e/pd,e/p/d} PARITY=${PARITY-e/pd,e/p/d}
else
  # The CPU form proves each step runs, in the one mode that exercises every stage and
  # both transfers; the modes' parity on the CPU is the test suite's.
  DEVICE=cpu BUILD=(--family qwen2-vl) MODEL=${MODEL:-models/tiny-qwen2-vl}
  REQUESTS=8 ENCODER_REQUESTS=32 ROUNDS=1 MODES=e/p/d PARITY=e/p/d
fi
RESULTS=${RESULTS:-bench/results/verify-$FORM}
DOC=${DOC:-docs/gpu.md}
ALL=smoke,serve,encoder,transfer
STEPS=${STEPS:-$ALL}
mkdir -p "$RESULTS"
if [ "$STEPS" = "$ALL" ] || [ ! -f "$RESULTS/commands.tsv" ]; then
  : >"$RESULTS/commands.tsv"
  date -u '+%Y-%m-%d %H:%M UTC' >"$RESULTS/when"
fi

failed=0
wanted() { case ",$STEPS,model," in *",$1,"*) return 0 ;; esac; return 1; }
# step NAME COMMAND...: runs it, logs it to RESULTS/NAME.log, records it in commands.tsv;
# a step STEPS leaves out passes without running.
step() {
  local name=$1 start status
  shift
  wanted "$name" || return 0
  echo "== $name: $*"
  start=$(date +%s%N)
  "$@" >"$RESULTS/$name.log" 2>&1
  status=$?
  printf '%s\t%d\t%d\t%s\n' "$name" $((($(date +%s%N) - start) / 1000000000)) "$status" "$*" \
    >>"$RESULTS/commands.tsv"
  if [ "$status" -ne 0 ]; then
    failed=1
    echo "   failed ($status); the end of $RESULTS/$name.log:"
    tail -n 20 "$RESULTS/$name.log" | sed 's/^/   /'
  fi
  return "$status"
}

step smoke "$PY" -m bench.smoke --device "$DEVICE" --out "$RESULTS/smoke.json"
if wanted serve || wanted encoder; then
  [ -f "$MODEL/config.json" ] || step model "$PY" -m prism.cli model build "${BUILD[@]}" --out "$MODEL"
fi
if [ -f "$MODEL/config.json" ]; then
  step serve "$PY" -m bench.serve --model "$MODEL" --modes "$MODES" --concurrency 1,32 \
    --requests "$REQUESTS" --no-same-engine --parity "$PARITY" --parity-prompts 4 \
    --parity-tokens 16 --out "$RESULTS/serve.json" --doc "$RESULTS/benchmarks.md"
  step encoder "$PY" -m bench.encoder --model "$MODEL" --device "$DEVICE" \
    --requests "$ENCODER_REQUESTS" --rounds "$ROUNDS" --out "$RESULTS/encoder.json"
fi
step transfer "$PY" -m bench.transfer --device "$DEVICE" --sizes 8 --reps 25 \
  --out "$RESULTS/transfer.json"
"$PY" -m bench.gpu_report --results "$RESULTS" --doc "$DOC" || failed=1
if [ "$failed" -ne 0 ]; then
  echo "verify-gpu: a step failed (see $RESULTS)"
  exit 1
fi
wanted serve || { echo "verify-gpu: $STEPS passed"; exit 0; }
# Parity is the bar: a mode whose tokens differ from the offline engine's fails the run, and
# so does a server that failed under load.
"$PY" - "$RESULTS/serve.json" "$PARITY" <<'PY'
import json, sys

serve, wanted = json.load(open(sys.argv[1])), sys.argv[2]
parity = serve.get("parity", {}).get("modes", {})
unequal = {mode: rows for mode, rows in parity.items() if not all(r["equal"] for r in rows)}
if unequal or (wanted and not parity):
    sys.exit(f"verify-gpu: not equal to the offline engine: {unequal or 'no mode checked'}")
if serve["not_run"]:
    sys.exit(f"verify-gpu: servers failed: {serve['not_run']}")
print(f"verify-gpu: {', '.join(parity) or 'no mode'} equal to the offline engine; every step passed")
PY
