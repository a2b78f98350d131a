"""What a sliding-window layer's decode attention costs on the CPU paths (docs/gemma3.md).

The cpu-native backend runs a sliding-window layer's decode rows on the C decode kernel
with its window bound (paged_decode.c `_window`); before that kernel had one, it ran them
through the torch backend's windowed views (only the blocks inside each row's window
gathered). This times one decode step of one layer, bf16, per configuration:

  c-full        the C kernel over the whole context (what ignoring the window would cost)
  c-window      the C kernel over a context of `window` tokens: the window bound's best
                case (the same work, aligned to the blocks)
  c-bound       the path the backend takes: the C kernel with the window bound, over the
                whole context's table
  torch-window  the torch backend over the window's blocks (what the cpu-native backend
                ran before the bound)

    python benchmarks/sliding_window_attention.py [--heads 4 --kv-heads 1 --head-dim 256]

Interleaved repeats; min/median/max in ms. The machine may be shared: read ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from treadle.layers.attention import AttentionLayer, AttentionStep
from treadle.worker.attention.torch_backend import TorchBackend
from treadle.worker.cpu.native_attention import CpuNativeBackend
from treadle.worker.cpu.native import load_kernels


def decode_step(batch: int, context: int, block_size: int, num_blocks: int) -> AttentionStep:
    per_row = -(-context // block_size)
    table = np.arange(batch * per_row, dtype=np.int64).reshape(batch, per_row) % num_blocks
    pos = context - 1
    slots = table[:, pos // block_size] * block_size + pos % block_size
    return AttentionStep(np.ones(batch, np.int64), np.arange(batch, dtype=np.int64),
                         np.full(batch, context - 1, np.int64), table, slots, batch,
                         block_size, num_blocks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    dtype, bs = torch.bfloat16, 16
    kernels = load_kernels("auto")
    if kernels is None:
        raise SystemExit("the C kernels could not be built here")
    backend = CpuNativeBackend(kernels, None, args.kv_heads, args.head_dim, dtype)
    torch_backend = TorchBackend(args.kv_heads)
    num_blocks = args.batch * -(-args.context // bs)
    torch.manual_seed(0)
    kv = torch.randn(2, args.kv_heads, num_blocks, bs, args.head_dim).to(dtype)
    qk = torch.randn(args.batch, args.heads + args.kv_heads, args.head_dim).to(dtype)
    value = torch.randn(args.batch, args.kv_heads, args.head_dim).to(dtype)
    scale = args.head_dim ** -0.5
    plain = AttentionLayer(args.heads, args.kv_heads, args.head_dim, scale)
    sliding = AttentionLayer(args.heads, args.kv_heads, args.head_dim, scale,
                             sliding_window=args.window)
    full_step = decode_step(args.batch, args.context, bs, num_blocks)
    cases = {  # name: (backend, layer, step)
        "c-full": (backend, plain, full_step),
        "c-window": (backend, plain, decode_step(args.batch, args.window, bs, num_blocks)),
        "c-bound": (backend, sliding, full_step),
        "torch-window": (torch_backend, sliding, full_step),
    }
    metas = {name: b.build_metadata(step, torch.device("cpu"))
             for name, (b, _, step) in cases.items()}
    times: dict[str, list[float]] = {name: [] for name in cases}
    with torch.inference_mode():
        for name, (b, layer, _) in cases.items():  # warm-up (builds the windowed views)
            b.forward(layer, qk, value, kv, metas[name], None)
        for _ in range(args.repeats):
            for name, (b, layer, _) in cases.items():
                start = time.perf_counter()
                for _ in range(20):
                    b.forward(layer, qk, value, kv, metas[name], None)
                times[name].append((time.perf_counter() - start) / 20 * 1e3)
    print(f"heads {args.heads}/{args.kv_heads}, head_dim {args.head_dim}, batch {args.batch}, "
          f"context {args.context}, window {args.window}, bf16, "
          f"{torch.get_num_threads()} threads")
    for name, values in times.items():
        print(f"{name:13s} min {min(values):.3f}  median {statistics.median(values):.3f}  "
              f"max {max(values):.3f} ms")


if __name__ == "__main__":
    main()
