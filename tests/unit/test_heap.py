"""keep_freed_memory: memory a step frees stays in the heap, so the next step does not
fault it in again (treadle/worker/cpu/heap.py). Each case runs in its own process: mallopt
changes the whole process, and the test process has engines in it."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from treadle.config import EngineConfig

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="mallopt is glibc's; elsewhere keep_freed_memory changes nothing (returns False)")

# A step's pattern in miniature: a few activation-sized buffers, written, freed, again.
ROUNDS = """
import ctypes, resource, sys
from treadle.worker.cpu.heap import keep_freed_memory
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "1":
    assert keep_freed_memory()
sizes = [6 << 20, 6 << 20, 2 << 20, 6 << 20]
counts = []
for _ in range(5):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffers = [libc.malloc(s) for s in sizes]
    for p, s in zip(buffers, sizes):
        ctypes.memset(p, 1, s)
    for p in reversed(buffers):
        libc.free(p)
    counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(*counts)
"""


def _faults_per_round(keep: bool) -> list[int]:
    out = subprocess.run([sys.executable, "-c", ROUNDS, "1" if keep else "0"],
                         capture_output=True, text=True, timeout=60, check=True)
    return [int(x) for x in out.stdout.split()]


def test_freed_buffers_are_reused_without_page_faults():
    counts = _faults_per_round(keep=True)
    assert counts[0] > 3000  # 20 MiB written: first touch faults
    assert max(counts[1:]) < 100, counts


def test_glibc_default_faults_the_same_buffers_in_every_round():
    # The reason for the module: without it glibc returns the freed top of the heap (or
    # the mappings) to the kernel, and each round pays the faults again.
    counts = _faults_per_round(keep=False)
    assert min(counts[1:]) > 1000, counts


def test_option_defaults_on_and_can_be_turned_off():
    assert EngineConfig.from_options(model="demo").model.keep_freed_memory is True
    config = EngineConfig.from_options(model="demo", keep_freed_memory=False)
    assert config.model.keep_freed_memory is False
