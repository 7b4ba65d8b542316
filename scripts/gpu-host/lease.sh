#!/usr/bin/env bash
# One lease's checks, in the call that carries the bundle's last part into /tmp/bundle:
#   1. install the bundle into /tmp/site
#   2. the oracle alone on the tiny Qwen2-VL: E/P/D's and E/PD's greedy answers beside one
#      offline engine's (scripts/gpu-host/parity.py; on a GPU the offline engine takes about
#      140 s and each mesh 120 s to start, so a lease has room for little more)
#   3. NIXL VRAM to VRAM with each UCX setting in UCX_SETTINGS, UCX logging its lanes
#   4. what time is left: verify-gpu's serve step on the tiny model (`vllm serve` and the
#      modes under load; parity was step 2), then on the qwen2-vl-2b preset
# each cut short so that the whole ends inside one call (BUDGET seconds). A call returns
# only a few files, so everything lands in one archive, $OUT/lease.tgz.
set -u
: "${OUT:?}"
BUDGET=${BUDGET:-570}
# One setting per line (VAR=value ...); "-" is none. By default: Prism's own (CUDA IPC's
# GET on), UCX printing the protocol it picks for each operation; then UCX's default, GET
# off without NVLink.
UCX_SETTINGS=${UCX_SETTINGS:-"UCX_PROTO_INFO=y"}
begin=$(date +%s)
left() { echo $((BUDGET - $(date +%s) + begin - ${1:-0})); }
at() { echo "$* after $(($(date +%s) - begin)) s"; }
work=/tmp/lease
mkdir -p $work
trap 'tar czf "$OUT/lease.tgz" -C $work . /tmp/prism-bench-* 2>/dev/null' EXIT

scripts/install_offline.sh /tmp/bundle /tmp/site >$work/install.log 2>&1 || { tail -30 $work/install.log; exit 1; }
at installed
export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >$work/nvidia-smi.txt 2>&1
python3 -m prism.cli model build --preset qwen2-vl-2b --out /tmp/qwen2-vl-2b >$work/model-2b.log 2>&1 &
# Carried with the last part (models/tiny-qwen2-vl, 4 MB) saves building it here (20 s).
if [ -f models/tiny-qwen2-vl/config.json ]; then
  cp -r models/tiny-qwen2-vl /tmp/tiny-qwen2-vl
else
  python3 -m prism.cli model build --family qwen2-vl --out /tmp/tiny-qwen2-vl >$work/model-tiny.log 2>&1
fi
cp docs/gpu.md $work/gpu.md
timeout "$(left 60)" python3 scripts/gpu-host/parity.py /tmp/tiny-qwen2-vl $work/parity e/p/d,e/pd
at "parity ended (exit $?)"
pkill -f -- '-m prism|-m vllm|vllm serve|VLLM::'; sleep 2

n=0
while IFS= read -r setting; do
  n=$((n + 1))
  (
    # shellcheck disable=SC2086 # a line may set several variables
    [ "$setting" = - ] || export $setting
    UCX_LOG_LEVEL=info timeout 60 python3 -m bench.transfer --device cuda --sizes 8 --reps 25 \
      --out $work/transfer-$n.json
  ) >$work/transfer-$n.log 2>&1
  echo "== transfer $n: $setting (exit $?)"
  grep -E 'cfg#|ucp_get|cuda_ipc|^ *(MiB|8 )' $work/transfer-$n.log | sed 's/^\[[0-9.]*\] \[[^]]*\] *//' | tail -6
done <<<"$UCX_SETTINGS"

export PY=python3 DOC=$work/gpu.md MODES=e/pd,e/p/d REQUESTS=16
if [ "$(left)" -gt 300 ]; then
  PARITY= RESULTS=$work/tiny MODEL=/tmp/tiny-qwen2-vl STEPS=serve timeout "$(left 10)" scripts/verify_gpu.sh
  at "tiny serve ended (exit $?)"
  grep -E 'parity|req/s|skipped|failed' $work/tiny/serve.log | tail -20
  pkill -f -- '-m prism|-m vllm|vllm serve|VLLM::'; sleep 2
fi
wait
if [ "$(left)" -gt 300 ]; then
  RESULTS=$work/2b MODEL=/tmp/qwen2-vl-2b STEPS=serve timeout "$(left 10)" scripts/verify_gpu.sh
  at "2b serve ended (exit $?)"
  grep -E 'parity|req/s|skipped|failed' $work/2b/serve.log | tail -20
fi
at done
