#!/bin/bash
# The kernel ISA levels side by side (docs/benchmarks.md, "Every CPU"): linear, decode and
# prefill kernels per level, then decode steps, with torch as it is and restricted to AVX2
# (an emulation of a CPU without AVX-512). 1 thread: on a shared, loaded machine the CPU-time
# fields are the steadier ones. Writes results/isa_levels/*.json. Run from the checkout with
# its venv active.
set -e
out=results/isa_levels; mkdir -p $out
mark() { echo "$(date +%T) $1 load: $(cut -d' ' -f1-3 /proc/loadavg)" >> $out/log.txt; }
EMU="ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2"
T1="--num-threads 1"
mark start
python benchmarks/linear_kernel.py --isa all --fp32 --repeats 15 $T1 > $out/linear_t1.json; mark linear
python benchmarks/attention_kernel.py --isa all --fp32 --threads 1 > $out/decode_t1.json; mark decode
python benchmarks/attention_kernel.py --isa all --threads 1 --prefill 0x512 512x512 1536x512 \
    > $out/prefill_t1.json; mark prefill
env $EMU python benchmarks/linear_kernel.py --isa avx2 --fp32 --repeats 9 --rows 1,4,16,64,512 $T1 \
    > $out/linear_emu_avx2_t1.json; mark linear_emu
env $EMU python benchmarks/attention_kernel.py --isa avx2 --threads 1 --prefill 0x512 512x512 \
    > $out/prefill_emu_avx2_t1.json; mark prefill_emu
python benchmarks/linear_kernel.py --skip-kernels --steps 15 --requests 4,64 --prompt-len 300 \
    --isa all --fp32 $T1 > $out/steps_t1.json; mark steps
env $EMU python benchmarks/linear_kernel.py --skip-kernels --steps 15 --requests 4,64 \
    --prompt-len 300 --isa avx2 --fp32 $T1 > $out/steps_emu_avx2_t1.json; mark steps_emu
