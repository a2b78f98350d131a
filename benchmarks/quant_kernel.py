"""The weight-only quantized kernels against the bf16 ones, per weight shape: what the
path rule of treadle/models/quant_weights.py is based on.

Owns two measurements, reported as they come (nothing here is a target; weights are
random, which does not change the speed of these kernels):

- gemv (default): for each SmolLM2-135M weight shape (N x K: o 576x576, down 576x1536,
  up 1536x576, k/v 192x576, gate_up 3072x576, LM head 49152x576), each format (Q8_0,
  Q4_0, Q4_1, Q4_K where K allows it, INT8) and M in --rows, the median ms per call of
  each quantized path (`dot`, `deq`, `deq_buffered`, the AMX ones where the CPU has AMX,
  `r16` on the repacked weight where the build has AVX-512 VNNI), of the bf16 C kernel
  (`NativeLayerOps.linear`) and of oneDNN (`F.linear` on bf16, and its prepacked kernel
  as the engine calls it); and GB/s = the bytes of the weight as that kernel reads it
  (quantized or bf16) per second (and the same at the fastest repeat: on a shared
  machine the median carries the other tenants' load). Each call reads another of `copies` copies of the
  weight (30 per layer shape, as the model's 30 layers; 3 of the LM head) so that the
  weights come from memory or L3, not L2, as in a real step. All kernels of a shape
  alternate within each repeat, so background load hits them alike.
- prefill (`--prefill`): at M in --prefill-rows, the quantized prefill path (tiles of
  --tile-rows dequantized to bf16 + F.linear) against dequantizing the whole weight once
  per call, against a kept bf16 copy (F.linear and the prepacked kernel) and, with AMX,
  against the AMX kernels (`amx`: dequantized bf16 tiles; `amx_dot`: int8 tiles), with
  the memory each holds.

Run: `python benchmarks/quant_kernel.py [--rows 1,4,16] [--formats Q8_0,Q4_0]
[--shapes o,down] [--repeats N] [--prefill] [--num-threads N]` (prints JSON).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SHAPES = {"o": (576, 576), "down": (576, 1536), "up": (1536, 576), "kv": (192, 576),
          "gate_up": (3072, 576), "lm_head": (49152, 576)}
"""name -> (N, K) of SmolLM2-135M's weights."""
FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "INT8")
LAYERS = 30


def _kernels(variant: str | None = None):
    """(quantized kernels, bf16 layer kernels or None): the engine's -march=native build,
    or the quantized kernels built for another ISA level (native_quant.ISA_VARIANTS)."""
    from treadle.worker.cpu.native import load_kernels
    from treadle.worker.cpu.native_linear import NativeLayerOps
    from treadle.worker.cpu.native_quant import ISA_VARIANTS, QuantKernels, build_variant

    built = load_kernels()
    lib = built.lib if built is not None else None
    quant = QuantKernels.load(lib) if variant is None else build_variant(ISA_VARIANTS[variant][0])
    if quant is None:
        raise SystemExit("the quantized C kernels are unavailable here (no compiler)")
    return quant, NativeLayerOps.load(lib)


def random_blocks(fmt: str, n: int, k: int, gen):
    """A random weight in `fmt` (valid blocks: finite small scales) and its bf16 dense form."""
    import torch

    from treadle.models.quant_formats import FORMATS as TABLE
    from treadle.models.quant_weights import QuantizedLinear

    if fmt == "INT8":
        return QuantizedLinear.quantize_int8(torch.randn(n, k, generator=gen))
    spec = TABLE[fmt]
    raw = torch.randint(0, 256, (n, k // spec.block_elems, spec.block_bytes), generator=gen,
                        dtype=torch.uint8)
    scale = (torch.rand(n, k // spec.block_elems, 2, generator=gen) * 0.01 + 0.001).half()
    raw[..., 0:4] = scale.view(torch.uint8).reshape(raw.shape[0], raw.shape[1], 4)
    if fmt == "Q8_0":
        raw[..., 2:] = torch.randint(-127, 128, raw[..., 2:].shape, generator=gen,
                                     dtype=torch.int8).view(torch.uint8)
    return QuantizedLinear(fmt, raw.reshape(n, -1).contiguous(), k)


def _packed_copies(dense: list) -> list:
    """oneDNN's packed copies of the bf16 weights `dense`, or [] where oneDNN cannot pack
    bf16 (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT: not on an AVX2-only CPU), and then
    only F.linear is timed."""
    import torch

    from treadle.worker.cpu.linear_kernels import _pack, packed_kernel_works

    return [_pack(w) for w in dense] if packed_kernel_works(torch.bfloat16) else []


def _median_ms(times: list[float]) -> float:
    return round(statistics.median(times) * 1e3, 4)


def _min_ms(times: list[float]) -> float:
    return round(min(times) * 1e3, 4)


def gemv(rows=(1, 4, 16), formats=FORMATS, shapes=tuple(SHAPES), repeats: int = 9,
         variant: str | None = None, copies_per_layer: int = LAYERS) -> list:
    import torch
    import torch.nn.functional as F

    from treadle.worker.cpu.linear_kernels import _packed_linear

    quant, bf16_ops = _kernels(variant)
    paths = ("dot", "deq", "deq_buffered") + (("amx", "amx_dot") if quant.has_amx else ())
    paths += ("gemm",) if quant.has_gemm else ()
    gen = torch.Generator().manual_seed(0)
    results = []
    for name in shapes:
        n, k = SHAPES[name]
        copies = min(3, copies_per_layer) if name == "lm_head" else copies_per_layer
        dense = [torch.randn(n, k, generator=gen).to(torch.bfloat16) for _ in range(copies)]
        packed = _packed_copies(dense)
        weights = {fmt: [random_blocks(fmt, n, k, gen) for _ in range(copies)]
                   for fmt in formats if k % (256 if fmt == "Q4_K" else 32) == 0}
        r16 = {fmt: [quant.r16_pack(fmt, w.blocks, k) for w in ws]
               for fmt, ws in weights.items() if fmt in quant.r16_formats}
        for m in rows:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            runs = {"onednn_linear": (lambda i: F.linear(x, dense[i]), n * k * 2)}
            if packed:
                runs["onednn_packed"] = (lambda i: _packed_linear(x, packed[i], None), n * k * 2)
            if bf16_ops is not None:
                runs["bf16_native"] = (lambda i: bf16_ops.linear(x, dense[i], None), n * k * 2)
            for fmt, ws in weights.items():
                for path in paths:
                    runs[f"{fmt}_{path}"] = (
                        lambda i, ws=ws, path=path: quant.gemv(
                            ws[i].format.name, ws[i].blocks, ws[i].scales, k, x, None, path),
                        ws[0].nbytes)
                if fmt in quant.r16_formats:
                    runs[f"{fmt}_r16"] = (
                        lambda i, fmt=fmt: quant.gemv_r16(fmt, r16[fmt][i], weights[fmt][i].scales,
                                                          n, k, x, None),
                        ws[0].nbytes)
            times: dict[str, list[float]] = {label: [] for label in runs}
            for _ in range(repeats):
                for label, (fn, _) in runs.items():
                    t0 = time.perf_counter()
                    for i in range(copies):
                        fn(i)
                    times[label].append((time.perf_counter() - t0) / copies)
            row = {"shape": name, "n": n, "k": k, "m": m, "kernels": {}}
            for label, (_, nbytes) in runs.items():
                ms, best = _median_ms(times[label]), _min_ms(times[label])
                row["kernels"][label] = {"ms": ms, "gb_s": round(nbytes / (ms * 1e-3) / 1e9, 1),
                                         "min_ms": best,
                                         "min_gb_s": round(nbytes / (best * 1e-3) / 1e9, 1)}
            results.append(row)
            print(json.dumps(_compact(row)), flush=True)
    return results


def _compact(row: dict) -> dict:
    return {"shape": row["shape"], "m": row["m"],
            **{label: f"{v['ms']}ms {v['gb_s']}GB/s (min {v['min_ms']})"
               for label, v in row["kernels"].items()}}


def prefill(rows=(64, 256, 512), formats=("Q8_0", "Q4_0"), shapes=("gate_up", "down"),
            tile_rows=(128, 256, 512), repeats: int = 5) -> list:
    import torch
    import torch.nn.functional as F

    from treadle.worker.cpu.linear_kernels import _packed_linear

    quant, _ = _kernels()
    gen = torch.Generator().manual_seed(1)
    results = []
    for name in shapes:
        n, k = SHAPES[name]
        copies = 3 if name == "lm_head" else 6
        dense = [torch.randn(n, k, generator=gen).to(torch.bfloat16) for _ in range(copies)]
        packed = _packed_copies(dense)
        for fmt in formats:
            if k % (256 if fmt == "Q4_K" else 32):
                continue
            ws = [random_blocks(fmt, n, k, gen) for _ in range(copies)]
            for w in ws:
                w.kernels = quant
            for m in rows:
                x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
                runs = {"bf16_copy_linear": lambda i: F.linear(x, dense[i]),
                        "dequant_whole": lambda i: F.linear(x, ws[i].dequantize(torch.bfloat16))}
                if packed:
                    runs["bf16_copy_packed"] = lambda i: _packed_linear(x, packed[i], None)
                for t in tile_rows:
                    def tiled(i, t=t):
                        ws[i].tile_rows = t
                        return ws[i]._prefill(x)
                    runs[f"tiles_{t}"] = tiled
                if quant.has_amx:
                    for path in ("amx", "amx_dot"):
                        runs[path] = lambda i, path=path: quant.gemv(
                            fmt, ws[i].blocks, ws[i].scales, k, x, None, path)
                times: dict[str, list[float]] = {label: [] for label in runs}
                for _ in range(repeats):
                    for label, fn in runs.items():
                        t0 = time.perf_counter()
                        for i in range(copies):
                            fn(i)
                        times[label].append((time.perf_counter() - t0) / copies)
                flops = 2 * m * n * k
                row = {"shape": name, "n": n, "k": k, "m": m, "format": fmt,
                       "memory_bytes": {"quantized": ws[0].nbytes, "bf16_copy": n * k * 2,
                                        "whole_dequant_buffer": n * k * 2,
                                        **{f"tiles_{t}_buffer": min(t, n) * k * 2
                                           for t in tile_rows}},
                       "kernels": {label: {"ms": _median_ms(v), "min_ms": _min_ms(v),
                                           "gflop_s": round(flops / statistics.median(v) / 1e9, 1)}
                                   for label, v in times.items()}}
                results.append(row)
                print(json.dumps({"shape": name, "m": m, "format": fmt,
                                  **{lb: f"{v['ms']}ms (min {v['min_ms']})"
                                     for lb, v in row["kernels"].items()}}),
                      flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,4,16")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--variant", default=None,
                        help="build the quantized kernels for this ISA level instead of "
                             "-march=native (treadle.worker.cpu.native_quant.ISA_VARIANTS)")
    parser.add_argument("--copies", type=int, default=LAYERS,
                        help="weight copies per layer shape (1: cache-resident)")
    parser.add_argument("--skip-gemv", action="store_true")
    parser.add_argument("--prefill", action="store_true", help="also measure the prefill path")
    parser.add_argument("--prefill-rows", default="64,256,512")
    parser.add_argument("--prefill-shapes", default="gate_up,down,lm_head")
    parser.add_argument("--tile-rows", default="128,256,512")
    parser.add_argument("--num-threads", type=int, default=None,
                        help="torch's (and so OpenMP's) thread count; default: torch's")
    args = parser.parse_args()
    import torch

    from treadle.measure.report import environment

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    ints = lambda s: tuple(int(v) for v in s.split(","))  # noqa: E731
    report = {"environment": environment(), "torch_threads": torch.get_num_threads(),
              "quant_isa": _kernels(args.variant)[0].isa}
    if not args.skip_gemv:
        report["gemv"] = gemv(ints(args.rows), tuple(args.formats.split(",")),
                              tuple(args.shapes.split(",")), args.repeats, args.variant,
                              args.copies)
    if args.prefill:
        report["prefill"] = prefill(ints(args.prefill_rows), tuple(args.formats.split(",")),
                                    tuple(args.prefill_shapes.split(",")),
                                    ints(args.tile_rows), max(3, args.repeats // 2))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
