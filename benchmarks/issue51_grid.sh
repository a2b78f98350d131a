#!/bin/bash
# Every figure of issue 51 in one go, for a QUIET machine (docs/benchmarks.md, "Issue 51").
#
# Expected run time: ~25 minutes on a quiet 2-core machine (an estimate from each part's
# single runs on a busy one; the parts' own estimates are in the comments below). It was
# not run end to end where it was written. Repeats are kept low to fit: one alternating
# repeat per point except the headline single stream (three). The first start on each GGUF
# file converts its config and tokenizer to a checkpoint under TREADLE_CACHE_DIR (~1 min for
# the 1B files on a busy machine); later runs reuse it: run once before timing, or add that.
#
#   . /path/to/venv/bin/activate; cd <checkout>
#   LLAMACPP_DIR=/work/peers/llama.cpp MODELS_DIR=/work/peers/models \
#   VLLM_PY=/work/peers/vllm-venv/bin/python bash benchmarks/issue51_grid.sh
#
# The files it reads (MODELS_DIR): the default model's Q4_1 file and Gemma 3 270M Q4_K_M
# (docs/benchmarks.md says where they come from), then the rest written by
#   python benchmarks/make_issue51_files.py --models $MODELS_DIR --llamacpp-dir $LLAMACPP_DIR
#
# Writes results/issue51/ (OUT=... to change): one JSON per figure, log.txt (each part's
# end time and the load average then: a part that ran at load > ~0.5 beside nothing else
# was not quiet), cpu.txt (the CPU model and flags every figure ran on), and prints the
# tables. Nothing here is asserted; read the ratios.
set -euo pipefail
cd "$(dirname "$0")/.."
LLAMACPP=${LLAMACPP_DIR:-/work/peers/llama.cpp}
MODELS=${MODELS_DIR:-/work/peers/models}
export VLLM_PY=${VLLM_PY:-/work/peers/vllm-venv/bin/python}
OUT=${OUT:-results/issue51}
mkdir -p "$OUT"
mark() { echo "$(date +%T) $1 load: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/log.txt"; }
{ lscpu | grep -E "Model name|^CPU\(s\)|Flags"; nproc; cat /sys/fs/cgroup/cpu.max 2>/dev/null || true; } \
    > "$OUT/cpu.txt"
PEER="--peer llamacpp --llamacpp-dir $LLAMACPP"
SMOL=$MODELS/SmolLM2-135M-Instruct
ONE_B=$MODELS/llama-3.2-1b-shape-random-seed0
mark start

# 1. Single stream and few streams against llama.cpp (item 1), 512-token prompts, 128
#    output tokens. The default file (Q4_1): concurrency 1 three times (~2 min), then 4,
#    16 and 64 once (~7 min: llama-server is the slow half at 64).
treadle bench latency --model $SMOL.Q4_1.gguf $PEER --concurrency 1 --repeats 3 \
    --output "$OUT/latency_q4_1_c1.json"; mark latency_q4_1_c1
treadle bench latency --model $SMOL.Q4_1.gguf $PEER --concurrency 4,16,64 --repeats 1 \
    --output "$OUT/latency_q4_1_served.json"; mark latency_q4_1_served
#    The other files at 1 and 16 streams, once each (~1.5 min each).
for file in $SMOL.Q8_0.gguf $SMOL.Q4_0.gguf $MODELS/gemma-3-270m-q4_k_m.gguf; do
    name=$(basename "$file" .gguf)
    treadle bench latency --model "$file" $PEER --concurrency 1,16 --repeats 1 \
        --output "$OUT/latency_$name.json"; mark "latency_$name"
done

# 5. The AVX2 kernel level forced (item 5), the default file, 1 and 16 streams (~1.5 min).
#    torch is not restricted here (benchmarks/isa_levels.sh emulates a CPU without
#    AVX-512 as a whole); the C kernels run their AVX2 level.
treadle bench latency --model $SMOL.Q4_1.gguf $PEER --concurrency 1,16 --repeats 1 \
    --kernel-isa avx2 --output "$OUT/latency_q4_1_avx2.json"; mark latency_avx2

# 2. The 1B shape at one stream against its memory floor (item 2), shorter outputs (the
#    step is what counts): Q8_0 and Q4_0 (~1.5 min each with llama-bench).
for q in Q8_0 Q4_0; do
    treadle bench latency --model $ONE_B.$q.gguf $PEER --concurrency 1 --repeats 1 \
        --prompt-len 512 --output-len 64 --output "$OUT/latency_1b_$q.json"
    python benchmarks/memory_floor.py --gguf $ONE_B.$q.gguf --config $ONE_B/config.json \
        --latency "$OUT/latency_1b_$q.json" | tee "$OUT/floor_1b_$q.json"; mark "floor_1b_$q"
done

# 3. The per-step time split at 1, 4 and 16 requests (item 3): the runner's short path
#    for plain greedy decode steps (worker/greedy_decode.py, the default) against the
#    general path (before), alternating, two repeats (~1.5 min).
python benchmarks/step_overhead.py --model $SMOL.Q4_1.gguf --requests 1,4,16 \
    --prompt-len 128 --output-len 128 --paths short,general --repeats 2 \
    --output "$OUT/step_split.json" | tee "$OUT/step_split.txt"; mark step_split

# 4. Default settings against vLLM's CPU build offline, bf16, engine-core workload
#    (item 4): default, makespan, vLLM, one repeat (~5 min with vLLM's start-up).
treadle bench compare benchmarks/issue51_offline.yaml --output "$OUT/offline"; mark offline

# 6. Throughput kept beside one busy thread (item 6): quiet, then with the load; the
#    share is loaded / quiet output tok/s per system (~7 min both).
treadle bench compare benchmarks/issue51_retention.yaml --output "$OUT/retention_quiet"
mark retention_quiet
python -m treadle.measure.background_load 1800 &
HOG=$!
trap 'kill $HOG 2>/dev/null || true' EXIT
treadle bench compare benchmarks/issue51_retention.yaml --output "$OUT/retention_load1"
kill $HOG; wait $HOG 2>/dev/null || true; trap - EXIT
mark retention_load1
python - "$OUT" <<'EOF'
import json, sys
out = sys.argv[1]
rows = {}
for tag in ("quiet", "load1"):
    with open(f"{out}/retention_{tag}/compare.json") as f:
        for row in json.load(f)["table"]:
            rows.setdefault(row["system"], {})[tag] = row["output tok/s"]
share = {s: {**v, "share": v["load1"] / v["quiet"]} for s, v in rows.items()}
print(json.dumps(share, indent=1))
json.dump(share, open(f"{out}/retention.json", "w"), indent=1)
EOF
mark done
