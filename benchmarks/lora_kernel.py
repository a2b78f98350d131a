"""The LoRA terms of one decode step, C kernel against the torch path, in process CPU time.

    OMP_NUM_THREADS=1 python benchmarks/lora_kernel.py [--isa avx2]

The benchmark model's LoRA targets of one layer (qkv, o, gate_up, down; rank 16 on every
module) for 12 decode rows split evenly over 1, 4 or 16 adapters, each path repeated on
the same inputs; prints microseconds per layer and milliseconds per 30-layer step. CPU
time, one thread: what the figures leave out is waiting for the core, so they hold on a
shared machine too.
"""

from __future__ import annotations

import argparse
import time

import torch

from treadle.lora import LoRARequest
from treadle.worker.lora.layers import TorchLoRAOps
from treadle.worker.cpu.native_lora import NativeLoRAOps
from treadle.worker.lora.weights import AdapterWeights, PartWeights, TargetWeights
from treadle.worker.cpu.native import load_kernels

TARGETS = {"qkv": (576, [(0, 576), (576, 768), (768, 960)]), "o": (576, [(0, 576)]),
           "gate_up": (576, [(0, 1536), (1536, 3072)]), "down": (1536, [(0, 576)])}
RANK, ROWS, LAYERS = 16, 12, 30


def random_adapter(seed: int, k: int, columns: list[tuple[int, int]]) -> AdapterWeights:
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(RANK * len(columns), k, generator=g) * 0.1).bfloat16().float()
    parts = tuple(PartWeights((c0, c1), (i * RANK, (i + 1) * RANK),
                              (torch.randn(c1 - c0, RANK, generator=g) * 0.1).bfloat16().float())
                  for i, (c0, c1) in enumerate(columns))
    return AdapterWeights(LoRARequest(f"a{seed}", seed + 1, "-"), {0: TargetWeights(a, parts)})


def per_call_us(ops, x, y, segments, repeats: int = 300) -> float:
    ops.prepare(segments)
    for _ in range(20):
        ops.apply_layer(0, x, y, segments)
    start = time.process_time()
    for _ in range(repeats):
        ops.apply_layer(0, x, y, segments)
    return (time.process_time() - start) / repeats * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--isa", default="auto", help="kernel ISA level (worker/cpu/cpu_isa.py)")
    torch.set_num_threads(1)
    kernels = load_kernels(parser.parse_args().isa)
    native = NativeLoRAOps.load(kernels.lib if kernels else None, 1)
    if native is None:
        raise SystemExit("the C LoRA kernel is not available on this CPU (needs AVX-512 or AVX2)")
    print(f"kernels {kernels.isa}; {ROWS} decode rows, rank {RANK} on every module")
    for num_adapters in (1, 4, 16):
        rows_each = ROWS // num_adapters if num_adapters <= ROWS else 1
        totals = {"torch": 0.0, "C": 0.0}
        for k, columns in TARGETS.values():
            adapters = [random_adapter(s, k, columns) for s in range(num_adapters)]
            segments = [(a, i * rows_each, (i + 1) * rows_each) for i, a in enumerate(adapters)]
            x = torch.randn(num_adapters * rows_each, k).bfloat16()
            y = torch.zeros(num_adapters * rows_each, columns[-1][1]).bfloat16()
            totals["torch"] += per_call_us(TorchLoRAOps(), x, y, segments)
            totals["C"] += per_call_us(native, x, y, segments)
        print(f"{num_adapters:2d} adapters x {rows_each} rows: per layer torch "
              f"{totals['torch']:7.1f} us, C {totals['C']:6.1f} us; per {LAYERS}-layer step "
              f"torch {totals['torch'] * LAYERS / 1e3:5.1f} ms, C {totals['C'] * LAYERS / 1e3:4.1f} ms"
              f" ({totals['torch'] / totals['C']:.1f}x)")


if __name__ == "__main__":
    main()
