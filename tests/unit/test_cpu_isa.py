"""The kernel ISA levels (worker/cpu/cpu_isa.py): which levels a CPU's flags allow, the order
`auto` tries them in, the error for a level the CPU cannot execute, each level's build
being what it says (vector width, vdpbf16ps or widening), what dtype=auto picks, and the
start-up line that says which kernels run."""

from __future__ import annotations

import logging

import pytest
import torch

from treadle.config import EngineConfig
from treadle.worker.cpu import cpu_isa
from treadle.worker.cpu import platform as cpu_platform
from treadle.worker.cpu.cpu_isa import (REQUIRED_CPU_FLAGS, candidate_levels, cpu_flags,
                                    describe_kernels, executable_levels)
from treadle.worker.cpu.native import load_kernels
from treadle.worker.cpu.native_linear import WIDENING_GEMM_ROWS, NativeLayerOps

LEVELS = executable_levels() or ["native"]
V3 = frozenset(REQUIRED_CPU_FLAGS["avx2"])
V4 = frozenset(REQUIRED_CPU_FLAGS["avx512"])
V4_BF16 = frozenset(REQUIRED_CPU_FLAGS["avx512bf16"])


def test_levels_a_cpu_executes_follow_its_flags():
    assert executable_levels(V4_BF16 | {"amx_bf16"}) == ["avx512bf16", "avx512", "avx2"]
    assert executable_levels(V4) == ["avx512", "avx2"]
    assert executable_levels(V3) == ["avx2"]
    assert executable_levels(V3 - {"fma"}) == []  # AVX2 without FMA is not x86-64-v3
    assert executable_levels(V3 | {"avx512f", "avx512_bf16"}) == ["avx2"]  # no BW/VL/DQ/CD
    # The avx512bf16 build also has VNNI (the quantized kernels' int8 dot products); every
    # CPU with AVX-512 BF16 has it, and one without it does not get that build.
    assert executable_levels(V4 | {"avx512_bf16"}) == ["avx512", "avx2"]


def test_candidates_in_the_order_auto_tries_them():
    assert candidate_levels("auto", V4_BF16) == ["avx512bf16", "avx512", "avx2", "native"]
    assert candidate_levels("auto", V3) == ["avx2", "native"]
    assert candidate_levels("auto", frozenset()) == ["native"]
    assert candidate_levels("avx2", V4) == ["avx2"]
    assert candidate_levels("native", V3) == ["native"]


def test_a_level_the_cpu_cannot_execute_is_an_error_naming_the_field():
    with pytest.raises(ValueError, match=r"kernel_isa='avx512'.*avx512f.*runs: avx2, native"):
        candidate_levels("avx512", V3)
    with pytest.raises(ValueError, match="kernel_isa must be one of auto, avx512bf16"):
        candidate_levels("sse4", V3)
    with pytest.raises(ValueError, match="kernel_isa must be one of"):
        EngineConfig.from_options(kernel_isa="avx1024")
    assert EngineConfig.from_options(kernel_isa="avx2").model.kernel_isa == "avx2"


def test_load_kernels_refuses_a_level_this_cpu_lacks(monkeypatch):
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda cpuinfo=None: V3)
    with pytest.raises(ValueError, match="kernel_isa='avx512bf16'"):
        load_kernels("avx512bf16")


def test_cpu_flags_reads_x86_and_arm_lines():
    x86 = "processor\t: 0\nflags\t\t: fpu avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu avx2 fma\n"
    assert cpu_flags(x86) == {"fpu", "avx2", "fma"}
    assert cpu_flags("processor\t: 0\nFeatures\t: fp asimd bf16\n") == {"fp", "asimd", "bf16"}
    assert cpu_flags("") == frozenset()


def test_the_avx512_level_adds_vnni_where_the_cpu_has_it():
    """A Xeon with AVX-512 VNNI but no AVX-512 BF16 (Cascade Lake, Ice Lake, a guest whose
    BF16 and AMX are hidden) builds the avx512 level with VNNI, so its quantized kernels
    have the r16 decode path; a CPU without VNNI keeps the plain AVX-512 build, and the
    other levels never add it (the AVX2 r16 path is the one without VNNI)."""
    assert cpu_isa.compile_flags("avx512", V4 | {"avx512_vnni"}) == [
        "-march=x86-64-v4", "-mavx512vnni", "-mtune=native"]
    assert cpu_isa.compile_flags("avx512", V4) == ["-march=x86-64-v4", "-mtune=native"]
    assert cpu_isa.compile_flags("avx2", V4 | {"avx512_vnni", "avx_vnni"}) == [
        "-march=x86-64-v3", "-mtune=native"]


def test_the_avx512_level_runs_the_r16_path_where_the_cpu_has_vnni():
    """What the extension is for, on this machine: the avx512 level's library has the r16
    decode path exactly when this CPU has AVX-512 VNNI (twin: the flags test above runs
    everywhere)."""
    from treadle.worker.cpu.native_quant import QuantKernels

    if "avx512" not in LEVELS:
        pytest.skip("this CPU does not run the avx512 level")
    kernels = load_kernels("avx512")
    assert QuantKernels(kernels.lib).has_r16 == ("avx512_vnni" in cpu_flags())


EXPECTED_BUILD = {"avx512bf16": (16, True), "avx512": (16, False), "avx2": (8, False)}


@pytest.mark.parametrize("level", LEVELS)
def test_each_level_builds_what_it_says(level):
    """The twins of the kernel tests exercise the code paths of CPUs without AVX-512 BF16
    only if each level's library really is built for that level."""
    kernels = load_kernels(level)
    assert kernels is not None and kernels.isa == level
    assert kernels.march == cpu_isa.compile_flags(level)
    if level in EXPECTED_BUILD:
        assert (kernels.simd_width, kernels.has_dpbf16) == EXPECTED_BUILD[level]
    vector = kernels.simd_width > 0
    assert kernels.supports_fast_decode(64, 3) is vector
    assert kernels.supports_fast_decode(128, 8) is vector
    assert not kernels.supports_fast_decode(80, 3) and not kernels.supports_fast_decode(64, 9)
    assert kernels.supports_prefill(torch.bfloat16, 128) is vector
    assert (NativeLayerOps.load(kernels.lib) is not None) is vector


def test_auto_dtype_is_bf16_where_the_widening_kernels_build(monkeypatch, caplog):
    monkeypatch.setattr(cpu_platform, "cpu_supports_bf16", lambda: False)
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda cpuinfo=None: V3)  # an AVX2-only CPU
    with caplog.at_level(logging.INFO, logger="treadle.models.loader"):
        assert cpu_platform.CPU.resolve_dtype("auto") is torch.bfloat16
    assert "dtype auto -> bfloat16" in caplog.text and "avx2" in caplog.text

    monkeypatch.setattr(cpu_platform, "load_kernels", lambda isa="auto": None)
    dtype, why = cpu_platform.auto_dtype()
    assert dtype is torch.float32 and "no AVX-512 or AVX2" in why
    monkeypatch.setattr(cpu_platform, "cpu_supports_bf16", lambda: True)
    assert cpu_platform.auto_dtype()[0] is torch.bfloat16


@pytest.mark.parametrize("level", LEVELS)
def test_describe_kernels_names_the_dtype_level_and_active_kernels(level):
    kernels = load_kernels(level)
    ops = NativeLayerOps.load(kernels.lib)
    line = describe_kernels(kernels, torch.bfloat16, head_dim=64, layer_ops=ops)
    assert line.startswith(f"dtype bfloat16; CPU kernels {level} ({' '.join(kernels.march)}, ")
    assert "\n" not in line
    if kernels.simd_width:
        assert ("vdpbf16ps" in line) is kernels.has_dpbf16
        assert (f"widened to fp32 in {kernels.simd_width}-lane" in line) is not kernels.has_dpbf16
        assert f"linear ({ops.describe()})" in line and "rope+kv write" in line
        if kernels.has_dpbf16:
            assert "tiled GEMM" not in line
        else:  # the widening levels: dot products for few rows, the tiled GEMM for more
            assert (f"dot products <= {WIDENING_GEMM_ROWS - 1} rows, tiled GEMM "
                    f"{WIDENING_GEMM_ROWS}-{ops.max_rows}") in line
        assert "decode attention, prefill attention, sampling" in line and "torch:" not in line
    line = describe_kernels(kernels, torch.float32, head_dim=80)
    assert line.startswith("dtype float32;")
    assert "decode attention (generic loops)" in line
    assert line.endswith("; torch: layers, prefill attention")
    assert describe_kernels(kernels, torch.bfloat16, 64, ops, native_attention=False).endswith(
        "; torch: attention")
    assert describe_kernels(None, torch.float32).startswith("dtype float32; no CPU kernels")
