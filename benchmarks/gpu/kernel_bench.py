"""Times the Triton kernels (treadle/worker/cuda/triton/) at real shapes on a GPU.

Prints, per case, the kernel's time (triton.testing.do_bench: median of repeated launches
after warm-up, L2 flushed between them), the bytes or FLOPs it must move or do, and the
rate achieved against the card's limits measured in the same run (a device-to-device copy
for bandwidth, an 8192^3 bf16 matmul for FLOP/s) and against the datasheet figures the
issue names (4.8 TB/s HBM, ~790 TFLOP/s bf16 as measured through torch). torch's SDPA
(FlashAttention on Hopper) on the same prefill without paging is timed beside ours.
Needs a CUDA GPU; writes a JSON result with --json.

    python benchmarks/gpu/kernel_bench.py --json kernels.json
    python benchmarks/gpu/kernel_bench.py --smoke   # CPU: tiny shapes, triton's interpreter;
                                                    # checks the script, not the kernels' speed
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

SMOKE = "--smoke" in sys.argv  # known before triton defines the kernels
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from treadle.worker.cuda.triton import (choose_num_splits, decode_attention,  # noqa: E402
                                   prefill_attention, write_kv)

HBM_BYTES_PER_S = 4.8e12
BF16_FLOPS = 790e12
# (name, num_heads, num_kv_heads, head_dim)
MODELS = [("llama-3.2-1b", 32, 8, 64), ("llama-3-8b", 32, 8, 128), ("gemma-d256", 8, 4, 256)]
DECODE = [(1, 4096), (1, 32768), (64, 1024), (64, 4096), (256, 1024), (256, 2048)]
# (new tokens per request, cached prefix per request, requests)
PREFILL = [(2048, 0, 1), (2048, 6144, 1), (1024, 1024, 4), (512, 0, 16)]
WRITE_TOKENS = (256, 8192)
LIMIT_SIZES = (1 << 30, 8192)  # copy bytes, matmul size
if SMOKE:
    MODELS = [("tiny", 4, 2, 16)]
    DECODE = [(1, 70), (3, 40)]
    PREFILL = [(20, 0, 1), (9, 30, 2)]
    WRITE_TOKENS = (5,)
    LIMIT_SIZES = (1 << 20, 128)
DEVICE = "cpu" if SMOKE else "cuda"


def do_bench(fn) -> float:
    """Milliseconds per call: triton's do_bench on a GPU; one call's time in a smoke run."""
    if DEVICE == "cuda":
        from triton.testing import do_bench as triton_do_bench
        return triton_do_bench(fn)
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def measure_limits() -> dict:
    n, m = LIMIT_SIZES
    src = torch.empty(n, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    copy_s = do_bench(lambda: dst.copy_(src)) / 1e3
    a = torch.randn(m, m, dtype=torch.bfloat16, device=DEVICE)
    b = torch.randn(m, m, dtype=torch.bfloat16, device=DEVICE)
    mm_s = do_bench(lambda: a @ b) / 1e3
    return {"copy_bytes_per_s": 2 * n / copy_s, "matmul_bf16_flops": 2 * m**3 / mm_s}


def paged_cache(num_seqs: int, seq_len: int, num_kv_heads: int, head_dim: int,
                block_size: int, dtype: torch.dtype, gen: torch.Generator):
    """K/V caches with each request's blocks scattered over the pool, and block tables."""
    blocks_per_seq = math.ceil(seq_len / block_size)
    num_blocks = num_seqs * blocks_per_seq
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.randn(shape, dtype=dtype, device=DEVICE, generator=gen)
    v = torch.randn(shape, dtype=dtype, device=DEVICE, generator=gen)
    perm = torch.randperm(num_blocks, device=DEVICE, generator=gen)
    tables = perm.view(num_seqs, blocks_per_seq).to(torch.int32)
    return k, v, tables


def bench_decode(limits: dict, dtype: torch.dtype, block_size: int, sms: int) -> list[dict]:
    rows = []
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    for name, heads, kv_heads, head_dim in MODELS:
        for num_seqs, seq_len in DECODE:
            k, v, tables = paged_cache(num_seqs, seq_len, kv_heads, head_dim, block_size,
                                       dtype, gen)
            q = torch.randn(num_seqs, heads, head_dim, dtype=dtype, device=DEVICE,
                            generator=gen)
            lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device=DEVICE)
            out = torch.empty_like(q)
            item = q.element_size()
            num_bytes = (2 * num_seqs * seq_len * kv_heads * head_dim * item
                         + 2 * q.numel() * item + tables.numel() * 4)
            splits = choose_num_splits(num_seqs, kv_heads, seq_len, sms)
            for s in sorted({1, splits}):
                t = do_bench(lambda: decode_attention(q, k, v, tables, lens, head_dim ** -0.5,
                                                      out, num_splits=s)) / 1e3
                rows.append({"kernel": "decode", "model": name, "dtype": str(dtype)[6:],
                             "block_size": block_size, "num_seqs": num_seqs,
                             "seq_len": seq_len, "num_splits": s, "us": t * 1e6,
                             "gb_per_s": num_bytes / t / 1e9,
                             "of_copy": num_bytes / t / limits["copy_bytes_per_s"],
                             "of_hbm": num_bytes / t / HBM_BYTES_PER_S})
    return rows


def causal_flops(num_new: int, num_cached: int, heads: int, head_dim: int) -> int:
    """QK^T and PV over the keys each query sees: 4 x head_dim x heads per (query, key)."""
    visible = num_new * num_cached + num_new * (num_new + 1) // 2
    return 4 * head_dim * heads * visible


def bench_prefill(limits: dict, dtype: torch.dtype, block_size: int) -> list[dict]:
    rows = []
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    for name, heads, kv_heads, head_dim in MODELS:
        for num_new, num_cached, num_seqs in PREFILL:
            seq_len = num_new + num_cached
            k, v, tables = paged_cache(num_seqs, seq_len, kv_heads, head_dim, block_size,
                                       dtype, gen)
            q = torch.randn(num_seqs * num_new, heads, head_dim, dtype=dtype, device=DEVICE,
                            generator=gen)
            qsl = torch.arange(0, num_seqs + 1, dtype=torch.int32, device=DEVICE) * num_new
            lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device=DEVICE)
            out = torch.empty_like(q)
            flops = num_seqs * causal_flops(num_new, num_cached, heads, head_dim)
            t = do_bench(lambda: prefill_attention(q, k, v, tables, qsl, lens,
                                                   head_dim ** -0.5, out)) / 1e3
            row = {"kernel": "prefill", "model": name, "dtype": str(dtype)[6:],
                   "block_size": block_size, "num_seqs": num_seqs, "num_new": num_new,
                   "num_cached": num_cached, "us": t * 1e6, "tflops": flops / t / 1e12,
                   "of_matmul": flops / t / limits["matmul_bf16_flops"],
                   "of_790": flops / t / BF16_FLOPS}
            if num_cached == 0:  # the same attention, contiguous, through torch's SDPA
                qs = q.view(num_seqs, num_new, heads, head_dim).transpose(1, 2)
                # K/V heads expanded up front: every SDPA backend takes that (flash too)
                ks = torch.randn(num_seqs, kv_heads, num_new, head_dim, dtype=dtype,
                                 device=DEVICE, generator=gen)
                ks = ks.repeat_interleave(heads // kv_heads, dim=1)
                t_sdpa = do_bench(lambda: F.scaled_dot_product_attention(
                    qs, ks, ks, is_causal=True)) / 1e3
                row["sdpa_us"] = t_sdpa * 1e6
                row["sdpa_tflops"] = flops / t_sdpa / 1e12
            rows.append(row)
    return rows


def bench_write_kv(limits: dict, dtype: torch.dtype, block_size: int) -> list[dict]:
    rows = []
    for name, _, kv_heads, head_dim in MODELS:
        for num_tokens in WRITE_TOKENS:
            num_blocks = 4 * math.ceil(num_tokens / block_size)
            kc = torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype,
                             device=DEVICE)
            vc = torch.zeros_like(kc)
            key = torch.randn(num_tokens, kv_heads, head_dim, dtype=dtype, device=DEVICE)
            value = torch.randn_like(key)
            slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
            t = do_bench(lambda: write_kv(key, value, kc, vc, slots)) / 1e3
            num_bytes = 4 * key.numel() * key.element_size()  # K and V, read and written
            rows.append({"kernel": "write_kv", "model": name, "dtype": str(dtype)[6:],
                         "num_tokens": num_tokens, "us": t * 1e6,
                         "gb_per_s": num_bytes / t / 1e9,
                         "of_copy": num_bytes / t / limits["copy_bytes_per_s"]})
    return rows


def print_rows(rows: list[dict], keys: list[str]) -> None:
    print("  ".join(f"{k:>11}" for k in keys))
    for row in rows:
        cells = []
        for k in keys:
            value = row.get(k, "")
            cells.append(f"{value:>11.3g}" if isinstance(value, float) else f"{value!s:>11}")
        print("  ".join(cells))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[16])
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run (see above)")
    args = parser.parse_args()
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("kernel_bench: no CUDA GPU (--smoke runs on CPU)")
        return 2
    if DEVICE == "cuda":
        props = torch.cuda.get_device_properties(0)
        name, num_sms = props.name, props.multi_processor_count
    else:
        name, num_sms = "cpu (smoke run: timings mean nothing)", 132
    limits = measure_limits()
    print(f"{name}: {num_sms} SMs; device copy "
          f"{limits['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
          f"{limits['matmul_bf16_flops'] / 1e12:.0f} TFLOP/s (measured now)")
    result = {"device": name, "limits": limits, "decode": [], "prefill": [],
              "write_kv": []}
    for block_size in args.block_sizes:
        for dtype in (torch.bfloat16,):
            result["decode"] += bench_decode(limits, dtype, block_size, num_sms)
            result["prefill"] += bench_prefill(limits, dtype, block_size)
            result["write_kv"] += bench_write_kv(limits, dtype, block_size)
    print("\ndecode attention (bytes: K and V of every context)")
    print_rows(result["decode"], ["model", "block_size", "num_seqs", "seq_len", "num_splits",
                                  "us", "gb_per_s", "of_copy", "of_hbm"])
    print("\nprefill attention (FLOPs: causal QK^T and PV)")
    print_rows(result["prefill"], ["model", "block_size", "num_seqs", "num_new", "num_cached",
                                   "us", "tflops", "of_matmul", "sdpa_tflops"])
    print("\nK/V write")
    print_rows(result["write_kv"], ["model", "num_tokens", "us", "gb_per_s", "of_copy"])
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
