"""Microbenchmark of the C attention kernels: decode (worker/cpu/kernels/paged_decode.c) and,
with --prefill, prefill (worker/cpu/kernels/paged_prefill.c) against torch's SDPA.

Times `paged_decode` on the benchmark model's head layout (SmolLM2-135M: 9 query heads,
3 KV heads, head_dim 64, bf16; blocks of 16 tokens unless --block-size) for several
(batch, context) shapes and prints JSON: milliseconds per call (best of several rounds)
and the K/V read rate in GB/s (bytes of K and V actually attended, divided by the time).
cpu_ms_per_call is the CPU time of all the process's threads per call: on a shared
machine, with --threads 1, it is the steadier measure of the kernel's own speed (time
spent descheduled is left out).

Like the model, each shape keeps one KV cache per layer and the timed loop cycles through
them, so the caches do not stay in the CPU's last-level cache between calls; the blocks of
each request are scattered at random in its cache, as after a while of serving.

    python benchmarks/attention_kernel.py                  # default shapes
    python benchmarks/attention_kernel.py --shapes 4x600 1x4000 --threads 1
    python benchmarks/attention_kernel.py --sequential     # blocks in order in memory
    python benchmarks/attention_kernel.py --block-size 64  # KV blocks of 64 tokens
    python benchmarks/attention_kernel.py --in-cache       # two layers: the arithmetic
    python benchmarks/attention_kernel.py --huge-pages     # caches as the engine's
    python benchmarks/attention_kernel.py --so old.so      # another build of the kernel
    python benchmarks/attention_kernel.py --prefill 0x512 512x512 1536x512
    python benchmarks/attention_kernel.py --isa all        # every ISA level, side by side

--in-cache cycles two layers' caches instead, small enough to stay in the last-level
cache at the shapes of a decode step (12 x 500 tokens: 9.2 MB), so the read rate is the
kernel's arithmetic, not the memory's. --huge-pages cuts the caches from transparent huge
pages (worker/cpu/huge_pages.py), as the engine's CPU caches are.

--prefill takes POSITIONS_BEFORExNEW_TOKENS pairs: one prefill chunk of NEW_TOKENS after
POSITIONS_BEFORE cached positions, per layer, timed in the C kernel and in torch's
scaled_dot_product_attention with the causal mask the torch path builds (same tensors;
the torch time leaves out the gather of the context, which the C time includes).

--isa picks the kernel builds (worker/cpu/cpu_isa.py): `auto` (the best this CPU runs), `all`
(every level it runs) or a comma list such as avx512bf16,avx2. With several, each shape's
rounds alternate between the levels (and SDPA), so background load hits all alike; the
rows then hold one `<field>_<level>` entry per level. `fp32` (decode only) adds the
float32 KV cache of the same shape, on the first level's f32 kernel: what a CPU whose
dtype falls back to float32 reads. `--int8` (decode only) adds the int8 cache
(`--kv-cache-dtype int8`, worker/kv_quant.py rows: head_dim values + a 2-byte scale) on
the first level's kernel, bf16 queries; its GB/s counts the int8 bytes read.

    python benchmarks/attention_kernel.py --int8 --threads 1
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import re
import time
from pathlib import Path

import torch

DEFAULT_SHAPES = ["1x4000", "4x600", "64x400", "256x200"]


def _kernels(so: str | None, isa: str = "auto") -> dict:
    """level name -> kernels (one entry for --so or a single level)."""
    if so:  # another build (of another version of the sources, say), all its kernels
        from treadle.worker.cpu.native import NativeKernels
        match = re.match(r"kernels-([a-z0-9]+)-", Path(so).name)
        return {"so": NativeKernels(ctypes.CDLL(so), match.group(1) if match else "native")}
    from treadle.worker.cpu.cpu_isa import executable_levels
    from treadle.worker.cpu.native import load_kernels
    levels = (executable_levels() or ["native"]) if isa == "all" else isa.split(",")
    found = {}
    for level in levels:
        kernels = load_kernels(level)
        if kernels is None:
            raise SystemExit(f"the C kernels could not be built for {level}")
        found[kernels.isa] = kernels
    return found


def _decode_case(batch: int, context: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 block_size: int, dtype: torch.dtype, min_cache_bytes: int, max_layers: int,
                 scattered: bool, seed: int, huge_pages: bool = False):
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = (context + block_size - 1) // block_size
    num_blocks = batch * blocks_per_req + 1
    layer_bytes = 2 * num_kv_heads * num_blocks * block_size * _row_bytes(head_dim, dtype)
    layers = max(2, min(max_layers, math.ceil(min_cache_bytes / layer_bytes)))
    if dtype == torch.int8:  # quantized rows; the queries stay bf16
        from treadle.worker.kv_quant import quantize
        caches = [quantize(torch.randn(2, num_kv_heads, num_blocks, block_size, head_dim,
                                       generator=gen), "int8") for _ in range(layers)]
        dtype = torch.bfloat16
    else:
        caches = [torch.randn(2, num_kv_heads, num_blocks, block_size, head_dim,
                              generator=gen).to(dtype) for _ in range(layers)]
    if huge_pages:
        from treadle.worker.cpu.huge_pages import HugePageArena
        arena = HugePageArena()
        caches = [arena.empty(c.numel(), c.dtype).view(c.shape).copy_(c) for c in caches]
    table = (torch.randperm(num_blocks - 1, generator=gen) if scattered
             else torch.arange(num_blocks - 1))[:batch * blocks_per_req]
    table = table.view(batch, blocks_per_req).contiguous()
    ctx = torch.full((batch,), context, dtype=torch.long)
    q = torch.randn(batch, num_heads, head_dim, generator=gen).to(dtype)
    return caches, table, ctx, q


def _row_bytes(head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one cached K or V row (an int8 row carries its 2-byte scale)."""
    return head_dim + 2 if dtype == torch.int8 else head_dim * dtype.itemsize


def bench_shape_levels(kernels: dict, batch: int, context: int, *, num_heads: int = 9,
                       num_kv_heads: int = 3, head_dim: int = 64, block_size: int = 16,
                       dtype: torch.dtype = torch.bfloat16, fp32: bool = False,
                       int8: bool = False,
                       min_cache_bytes: int = 256 << 20, max_layers: int = 30, rounds: int = 7,
                       min_round_s: float = 0.05, scattered: bool = True, seed: int = 0,
                       huge_pages: bool = False) -> dict:
    """Decode attention of one (batch, context) shape with each of `kernels` (name ->
    kernels), rounds alternating; fp32: also the float32 cache on the first one's kernel."""
    args = (batch, context, num_heads, num_kv_heads, head_dim, block_size)
    cases = {dtype: _decode_case(*args, dtype, min_cache_bytes, max_layers, scattered, seed,
                                 huge_pages)}
    if fp32 and dtype != torch.float32:
        cases[torch.float32] = _decode_case(*args, torch.float32, min_cache_bytes, max_layers,
                                            scattered, seed, huge_pages)
    scale = head_dim ** -0.5
    variants = {name: (k, dtype) for name, k in kernels.items()}
    if torch.float32 in cases and dtype != torch.float32:
        variants["fp32"] = (next(iter(kernels.values())), torch.float32)
    if int8:
        cases[torch.int8] = _decode_case(*args, torch.int8, min_cache_bytes, max_layers,
                                         scattered, seed, huge_pages)
        variants["int8"] = (next(iter(kernels.values())), torch.int8)

    def one_pass(k, dt):
        caches, table, ctx, q = cases[dt]
        out = torch.empty_like(q)
        for c in caches:
            k.paged_decode(q, c[0], c[1], table, ctx, out, scale)

    passes = {}
    for name, (k, dt) in variants.items():
        one_pass(k, dt)  # warm up (page faults, thread pool)
        passes[name] = max(1, math.ceil(min_round_s / max(_timed(lambda: one_pass(k, dt))[0],
                                                           1e-6)))
    best = dict.fromkeys(variants, math.inf)
    best_cpu = dict.fromkeys(variants, math.inf)
    for _ in range(rounds):
        for name, (k, dt) in variants.items():
            layers = len(cases[dt][0])
            elapsed, cpu = _timed(lambda: [one_pass(k, dt) for _ in range(passes[name])])
            best[name] = min(best[name], elapsed / (passes[name] * layers))
            best_cpu[name] = min(best_cpu[name], cpu / (passes[name] * layers))
    row = {"batch": batch, "context": context, "layers_cycled": len(cases[dtype][0])}
    for name, (_, dt) in variants.items():
        kv_bytes = 2 * batch * context * num_kv_heads * _row_bytes(head_dim, dt)
        suffix = "" if len(variants) == 1 else f"_{name}"
        row[f"ms_per_call{suffix}"] = round(best[name] * 1e3, 4)
        row[f"cpu_ms_per_call{suffix}"] = round(best_cpu[name] * 1e3, 4)
        row[f"kv_bytes_per_call{suffix}"] = kv_bytes
        row[f"gb_per_s{suffix}"] = round(kv_bytes / best[name] / 1e9, 2)
    return row


def bench_shape(kernels, batch: int, context: int, **options) -> dict:
    """Decode attention of one (batch, context) shape with one build of the kernels."""
    return bench_shape_levels({"kernels": kernels}, batch, context, **options)


def bench_prefill(kernels, start: int, new: int, **options) -> dict:
    """ms per layer of one prefill chunk: the C kernel and torch's SDPA."""
    return bench_prefill_levels({"native": kernels}, start, new, **options)


def bench_prefill_levels(kernels: dict, start: int, new: int, *, num_heads: int = 9,
                         num_kv_heads: int = 3, head_dim: int = 64, block_size: int = 16,
                         rounds: int = 7, seed: int = 0) -> dict:
    """ms per layer of one prefill chunk with each of `kernels` (name -> kernels; one
    entry named `native` gives the plain native_ms/speedup fields; a build with the AMX
    compute path here is timed on it too, as `NAME_amx`, fields suffixed `_amx` for
    `native`) and torch's SDPA as the engine calls it (the causal flag for a first chunk,
    else a float mask), rounds alternating."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(seed)
    ctx = start + new
    num_blocks = (ctx + block_size - 1) // block_size
    cache = torch.randn(2, num_kv_heads, num_blocks, block_size, head_dim,
                        generator=gen).bfloat16()
    q = torch.randn(new, num_heads, head_dim, generator=gen).bfloat16()
    spans = torch.tensor([[0, new, start]], dtype=torch.int64)
    table = torch.randperm(num_blocks, generator=gen).view(1, -1).contiguous()
    out = torch.empty(new, num_heads * head_dim, dtype=torch.bfloat16)
    workspace = next(iter(kernels.values())).prefill_workspace(spans, num_kv_heads, head_dim)
    scale = head_dim ** -0.5
    # The torch path's operands: the context gathered in order, and the causal mask.
    k = cache[0][:, table[0]].reshape(num_kv_heads, -1, head_dim)[:, :ctx].unsqueeze(0)
    v = cache[1][:, table[0]].reshape(num_kv_heads, -1, head_dim)[:, :ctx].unsqueeze(0)
    allowed = torch.arange(ctx)[None, :] <= (start + torch.arange(new))[:, None]
    bias = torch.zeros(allowed.shape).masked_fill(~allowed, -math.inf).bfloat16()
    qt = q.transpose(0, 1).unsqueeze(0)

    def sdpa():
        if start == 0:
            F.scaled_dot_product_attention(qt, k, v, is_causal=True, scale=scale,
                                           enable_gqa=True)
        else:
            F.scaled_dot_product_attention(qt, k, v, attn_mask=bias, scale=scale,
                                           enable_gqa=True)

    runs = {}
    for name, kn in kernels.items():
        runs[name] = (lambda kn=kn: kn.paged_prefill(q, cache[0], cache[1], spans, table, out,
                                                     workspace, scale))
        if kn.supports_amx_prefill(head_dim):
            runs[f"{name}_amx"] = (lambda kn=kn: kn.paged_prefill(
                q, cache[0], cache[1], spans, table, out, workspace, scale, amx=True))
    runs["sdpa"] = sdpa
    for fn in runs.values():
        fn()
    times = dict.fromkeys(runs, math.inf)
    cpu_times = dict.fromkeys(runs, math.inf)
    for _ in range(rounds):
        for name, fn in runs.items():
            elapsed, cpu = _timed(lambda: [fn() for _ in range(5)])
            times[name] = min(times[name], elapsed / 5)
            cpu_times[name] = min(cpu_times[name], cpu / 5)
    useful_flops = 4 * head_dim * num_heads * (new * start + new * (new + 1) / 2)
    row = {"positions_before": start, "new_tokens": new,
           "sdpa_ms": round(times["sdpa"] * 1e3, 3),
           "sdpa_cpu_ms": round(cpu_times["sdpa"] * 1e3, 3)}
    for name in (n for n in runs if n != "sdpa"):
        suffix = {"native": "", "native_amx": "_amx"}.get(name, f"_{name}")
        row[f"native_ms{suffix}"] = round(times[name] * 1e3, 3)
        row[f"native_cpu_ms{suffix}"] = round(cpu_times[name] * 1e3, 3)
        row[f"speedup{suffix}"] = float(f"{times['sdpa'] / times[name]:.3g}")
        row[f"native_useful_gflop_s{suffix}"] = round(useful_flops / times[name] / 1e9, 1)
    return row


def _timed(fn) -> tuple[float, float]:
    """Wall-clock and CPU seconds (all of the process's threads) of fn()."""
    start, start_cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - start, time.process_time() - start_cpu


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES,
                        help="BATCHxCONTEXT pairs (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None, help="OpenMP/torch threads")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds, best kept")
    parser.add_argument("--sequential", action="store_true", help="each request's blocks "
                        "one after another in memory (default: scattered at random)")
    parser.add_argument("--so", default=None, help="a shared object to load instead of the "
                        "kernels that treadle builds")
    parser.add_argument("--prefill", nargs="+", default=None, metavar="STARTxNEW",
                        help="time the prefill kernel against SDPA for these chunks instead")
    parser.add_argument("--isa", default="auto", help="kernel ISA levels: auto, all, or a "
                        "comma list such as avx512bf16,avx512,avx2 (default: %(default)s)")
    parser.add_argument("--fp32", action="store_true", help="decode: also time the float32 "
                        "cache of each shape (what a CPU on the float32 fallback reads)")
    parser.add_argument("--int8", action="store_true", help="decode: also time the int8 "
                        "cache of each shape (--kv-cache-dtype int8)")
    parser.add_argument("--block-size", type=int, default=16, help="decode: tokens per KV "
                        "block (default: %(default)s)")
    parser.add_argument("--in-cache", action="store_true", help="decode: cycle two layers' "
                        "caches, which stay in the last-level cache (the kernel's arithmetic)")
    parser.add_argument("--huge-pages", action="store_true", help="decode: the caches in "
                        "transparent huge pages, as the engine's")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    kernels = _kernels(args.so, args.isa)
    single = len(kernels) == 1
    levels = {"levels": {name: getattr(k, "march", None) for name, k in kernels.items()}}
    if args.prefill:
        for name, k in kernels.items():
            if not k.supports_prefill(torch.bfloat16, 64):
                raise SystemExit(f"the {name} build has no prefill kernel (no AVX-512 or AVX2)")
        named = {"native": next(iter(kernels.values()))} if single else kernels
        rows = [bench_prefill_levels(named, *(int(x) for x in spec.lower().split("x")),
                                     rounds=args.rounds) for spec in args.prefill]
        print(json.dumps({"layout": {"num_heads": 9, "num_kv_heads": 3, "head_dim": 64,
                                     "block_size": 16, "dtype": "bfloat16"}, **levels,
                          "threads": torch.get_num_threads(), "prefill": rows}, indent=2))
        return
    results = []
    for spec in args.shapes:
        batch, context = (int(x) for x in spec.lower().split("x"))
        results.append(bench_shape_levels(kernels, batch, context, rounds=args.rounds,
                                          scattered=not args.sequential, fp32=args.fp32,
                                          int8=args.int8, block_size=args.block_size,
                                          huge_pages=args.huge_pages,
                                          **({"min_cache_bytes": 0} if args.in_cache else {})))
    print(json.dumps({"layout": {"num_heads": 9, "num_kv_heads": 3, "head_dim": 64,
                                 "block_size": args.block_size, "dtype": "bfloat16",
                                 "blocks": "sequential" if args.sequential else "scattered",
                                 "in_cache": args.in_cache, "huge_pages": args.huge_pages},
                      **levels, "threads": torch.get_num_threads(), "results": results},
                     indent=2))


if __name__ == "__main__":
    main()
