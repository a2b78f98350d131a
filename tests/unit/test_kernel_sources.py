"""The C kernels' sources: no variable-length arrays at any ISA level.

A micro-kernel that sizes a local array by one of its `const int` arguments (rows, head
dim) declares a variable-length array even when every call passes a literal, and gcc keeps
such arrays in memory: the prefill kernel's value accumulators were loaded and stored
around every vdpbf16ps that way (docs/benchmarks.md, round 17). Syntax-only compiles with
`-Werror=vla`, with each level's own flags (the code each level compiles differs)."""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from treadle.worker.cpu import native

LEVELS = ("avx512bf16", "avx512", "avx2")


@pytest.mark.skipif(native._compiler() is None, reason="no C compiler on this machine")
def test_no_variable_length_arrays_in_the_kernels():
    compiler = native._compiler()
    jobs = [(source, level) for level in LEVELS for source in native._sources()]

    def check(job):
        source, level = job
        flags = [f for f in native._compile_flags(source, level) if f != "-c"]
        result = subprocess.run([compiler, *flags, "-fsyntax-only", "-Werror=vla",
                                 str(source)], capture_output=True, text=True, timeout=120)
        return f"{source.name} ({level}): {result.stderr.strip()}" if result.returncode else None

    with ThreadPoolExecutor(2) as pool:
        failures = [f for f in pool.map(check, jobs) if f]
    assert not failures, "\n".join(failures)
