"""Attention of short multi-token rows (speculative verification) on the CPU kernels.

Times one layer's attention for a row of L query tokens over C cached tokens (SmolLM2's
heads: 9 query heads, 3 KV heads, head_dim 64, bf16) two ways: the prefill kernel
(paged_prefill.c, which packs the row's context into tiles) and the decode kernel with
one kernel row per query token (what the cpu-native backend does for rows of at most
SHORT_ROW_TOKENS tokens), and prints both with their largest difference.

    python benchmarks/verify_attention.py [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch

from treadle.worker.cpu.native_attention import SHORT_ROW_TOKENS
from treadle.worker.cpu.native import load_kernels


def timed(fn, repeats: int) -> float:
    for _ in range(10):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = load_kernels()
    heads, kv_heads, head_dim, block_size, num_blocks = 9, 3, 64, 16, 400
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim,
                          generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim,
                          generator=gen).to(torch.bfloat16)
    print(f"short-row limit in the backend: {SHORT_ROW_TOKENS} tokens; us per layer call")
    for ctx in (100, 800, 2000):
        for q_len in (1, 2, 5, 9, 17):
            blocks = (ctx + q_len + block_size - 1) // block_size
            table = torch.arange(blocks, dtype=torch.int64)[None]
            query = torch.randn(q_len, heads, head_dim, generator=gen).to(torch.bfloat16)
            out = torch.empty(q_len, heads * head_dim, dtype=torch.bfloat16)
            spans = torch.tensor([[0, q_len, ctx]], dtype=torch.int64)
            workspace = kernels.prefill_workspace(spans, kv_heads, head_dim)
            prefill_us = timed(lambda: kernels.paged_prefill(
                query, k_cache, v_cache, spans, table, out, workspace, 0.125), args.repeats)
            tables = table.repeat(q_len, 1).contiguous()
            ctx_lens = torch.arange(ctx + 1, ctx + q_len + 1, dtype=torch.int64)
            out_rows = torch.empty(q_len, heads, head_dim, dtype=torch.bfloat16)
            decode_us = timed(lambda: kernels.paged_decode(
                query, k_cache, v_cache, tables, ctx_lens, out_rows, 0.125), args.repeats)
            diff = (out_rows.view(q_len, -1).float() - out.float()).abs().max().item()
            print(f"context {ctx:5d}, {q_len:2d} queries: prefill kernel {prefill_us:7.1f}, "
                  f"decode rows {decode_us:7.1f} ({prefill_us / decode_us:4.2f}x), "
                  f"max diff {diff:.4f}")


if __name__ == "__main__":
    main()
