"""`treadle build-kernels`: build the C kernels ahead of the first start (the README's
install line runs it), instead of during it.

Builds, into treadle's cache (`$TREADLE_CACHE_DIR/kernels`), the kernel library of every
ISA level this CPU executes (worker/cpu/cpu_isa.py; the engine's `--kernel-isa auto` takes
the best of them, the tests run every one) and the quantized kernels' per-level variants
(worker/cpu/native_quant.py `ISA_VARIANTS`, which the tests and benchmarks build), or
only what `--isa` names. Already built libraries are kept (the cache key covers sources,
flags, compiler and CPU). Exit status 1 when a build the engine would use fails or no C
compiler is found (the engine then runs the slower torch paths). This module parses
arguments and calls worker/cpu's builders; it holds no build logic.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from treadle.config import KERNEL_ISA_CHOICES


def _cmd_build_kernels(args: argparse.Namespace) -> int:
    from treadle.worker.cpu import cpu_isa, native, native_quant

    if native.compiler() is None:
        print("error: no C compiler found (gcc or $CC): install gcc (e.g. apt-get install -y "
              "gcc); without it the engine runs the slower torch paths", file=sys.stderr)
        return 1
    levels = (cpu_isa.executable_levels() or ["native"]) if args.isa == "all" else [args.isa]
    failed = []
    for level in levels:
        start = time.perf_counter()
        kernels = native.load_kernels(level)
        if kernels is None:
            failed.append(level)
            print(f"{level}: failed (see the log above)")
        else:
            print(f"{level}: {native.library_path(kernels.isa)} "
                  f"({time.perf_counter() - start:.1f} s)")
    if args.isa == "all" and args.quant_variants:
        _build_quant_variants(native_quant)
    if failed:
        print(f"error: the C kernels for {', '.join(failed)} did not build", file=sys.stderr)
        return 1
    return 0


def _build_quant_variants(native_quant) -> None:
    """The quantized kernels of every ISA_VARIANTS level this CPU runs, as many at once as
    there are cores (each compiles its sources one after another)."""
    from concurrent.futures import ThreadPoolExecutor

    variants = [v for v in native_quant.ISA_VARIANTS if native_quant.cpu_runs(v)]

    def build(name: str) -> str:
        start = time.perf_counter()
        built = native_quant.build_variant(native_quant.ISA_VARIANTS[name][0])
        return (f"quantized kernels {name}: " + ("unavailable" if built is None else
                                                 f"{time.perf_counter() - start:.1f} s"))

    with ThreadPoolExecutor(max(1, min(len(variants), os.cpu_count() or 1))) as pool:
        for line in pool.map(build, variants):
            print(line, flush=True)


def add_parser(sub) -> None:
    """Register `build-kernels` on the top-level subparsers."""
    cmd = sub.add_parser("build-kernels", help="build the C kernels ahead of the first start "
                                               "(every ISA level this CPU runs)")
    cmd.add_argument("--isa", default="all", choices=("all", *KERNEL_ISA_CHOICES),
                     help="all: every level this CPU executes and the quantized kernels' "
                          "variants; auto: the level the engine picks; or one level")
    cmd.add_argument("--quant-variants", default=True, action=argparse.BooleanOptionalAction,
                     help="with --isa all, also the quantized kernels built per ISA level "
                          "(what the tests and benchmarks use)")
    cmd.set_defaults(func=_cmd_build_kernels)
