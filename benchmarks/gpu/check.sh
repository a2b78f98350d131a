#!/usr/bin/env bash
# The GPU check in one go, on one H200, in under 8 minutes (docs/gpu.md):
#   environment -> Triton kernel tests (compiled, every test of the file, real shapes
#   included) -> kernel timings -> decode/prefill steps of a 1B layer stack with CUDA
#   graphs -> engine-level checks on treadle's CUDA platform with the triton backend
#   (token equality with transformers, engine-core workload vs static batching, decode
#   step vs HBM floor at batch 1/64/256, prefill MFU).
# Runs with the machine's python3 and its packages; treadle comes from this source tree
# (PYTHONPATH), nothing is installed and no wheels are needed. Each step has its own
# time limit; the log and the JSON results go to $OUT (the device tool's folder) or a
# temporary one. Exits 1 when any step failed.
#
#   bash benchmarks/gpu/check.sh            # everything
#   STEPS="tests bench" bash benchmarks/gpu/check.sh
set -uo pipefail
cd "$(dirname "$0")/../.."

out="${OUT:-$(mktemp -d)}"
work="$(mktemp -d)"
log="$out/check.log"
steps="${STEPS:-environment tests bench stack engine}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TREADLE_CACHE_DIR="${TREADLE_CACHE_DIR:-$work/cache}"
unset TRITON_INTERPRET
status=0

run_step() {  # name, time limit in seconds, command...
  local name=$1 limit=$2
  shift 2
  case " $steps " in *" $name "*) ;; *) return 0 ;; esac
  echo "=== $name (limit ${limit}s): $*" | tee -a "$log"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0))s" | tee -a "$log"
  [ "$rc" -eq 0 ] || status=1
}

parallel=()
python3 -c "import xdist" 2>/dev/null && parallel=(-n 8)  # compiles in parallel

run_step environment 30 python3 benchmarks/gpu/environment.py
run_step tests 120 python3 -m pytest -q -p no:cacheprovider "${parallel[@]}" \
  tests/integration/test_triton_kernels.py tests/integration/test_triton_backend.py \
  tests/unit/test_cuda_support.py
run_step bench 80 python3 benchmarks/gpu/kernel_bench.py --json "$out/kernels.json"
run_step stack 60 python3 benchmarks/gpu/decode_step.py --json "$out/decode_step.json"
run_step engine 190 python3 benchmarks/gpu/engine_check.py --work-dir "$work" \
  --json "$out/engine.json"

echo "check finished: status $status; results in $out" | tee -a "$log"
exit "$status"
