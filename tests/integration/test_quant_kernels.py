"""The weight-only quantized kernels (worker/cpu/native_quant.py, kernels/quant_*.c) against
dequantize-then-matmul references built from gguf.quants.dequantize, on every ISA level
they have code for: the engine's -march=native build, and the same sources built for
AVX-512 BF16 (no AMX), AVX-512 VNNI, AVX-512F alone, AVX2 + AVX-VNNI, AVX2 and plain C
(native_quant.ISA_VARIANTS), each run where this CPU can (the AVX2 and plain-C builds run
on any x86-64 test machine)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from quant_data import make_weight

from treadle.models.quant_weights import r16_at_every_row_count
from treadle.worker.cpu.linear_kernels import packed_kernel_works
from treadle.worker.cpu.native import load_kernels
from treadle.worker.cpu.native_quant import (ISA_VARIANTS, QuantKernelError, QuantKernels,
                                         build_variant, cpu_runs)

FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "INT8")
SHAPES = {  # (N, K): N not a multiple of any tile; K at the edges each format allows
    "Q8_0": [(1, 32), (17, 96), (100, 512)],
    "Q4_0": [(1, 32), (17, 96), (100, 512)],
    "Q4_1": [(1, 32), (17, 96), (100, 512)],
    "Q4_K": [(1, 256), (17, 768), (33, 512)],
    "INT8": [(1, 1), (17, 33), (5, 100), (100, 512)],
}
ROWS = (1, 3, 16, 17, 64, 200)


@pytest.fixture(scope="module", params=["native", *ISA_VARIANTS])
def kernels(request) -> QuantKernels:
    if request.param == "native":
        built = load_kernels()
        assert built is not None, "the C kernels must build on the test machine (gcc)"
        found = QuantKernels.load(built.lib)
        assert found is not None, "the engine's library lacks the quantized kernels"
        return found
    if not cpu_runs(request.param):
        pytest.skip(f"this CPU cannot run the {request.param} build (the avx2 and scalar "
                    "builds cover the same code paths' fallbacks)")
    found = build_variant(ISA_VARIANTS[request.param][0])
    assert found is not None, "gcc is required"
    return found


def expected_isa(name: str, kernels: QuantKernels) -> None:
    level = {"avx512-bf16": "avx512+bf16+vnni", "avx512-vnni": "avx512+vnni",
             "avx512f": "avx512", "avx2-vnni": "avx2+vnni", "avx2": "avx2", "scalar": "scalar"}
    if name in level:
        # AMX is compiled into every AVX-512 BF16 build and runs where the CPU has it
        amx = "+amx" if name == "avx512-bf16" and _cpu_has_amx() else ""
        assert kernels.isa == level[name] + amx


def _cpu_has_amx() -> bool:
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")),
                     [])
    return all(flag in flags for flag in ("amx_tile", "amx_bf16", "amx_int8"))


def test_each_build_runs_its_own_level(kernels, request):
    expected_isa(request.node.callspec.params["kernels"], kernels)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_matches_gguf(kernels, fmt):
    exact = fmt in ("Q8_0", "Q4_0", "INT8")  # one rounding, as gguf: else fma vs mul + add
    for i, (n, k) in enumerate(SHAPES[fmt]):
        weight, ref = make_weight(fmt, n, k, seed=i, kernels=kernels)
        ref = torch.from_numpy(ref)
        got = weight.dequantize()
        if exact:
            assert torch.equal(got, ref)
        else:
            torch.testing.assert_close(got, ref, rtol=3e-7, atol=1e-9)
        as_bf16 = weight.dequantize(torch.bfloat16)
        assert (as_bf16 != ref.to(torch.bfloat16)).float().mean() <= (0 if exact else 1e-3)
        torch.testing.assert_close(as_bf16.float(), ref, rtol=2 ** -8, atol=0)
        n0, n1 = n // 3, n
        part = kernels.dequantize(fmt, weight.blocks, weight.scales, k, rows=(n0, n1))
        assert torch.equal(part, got[n0:n1])


def _reference(kernels, path, weight, w_ref, x, bias):
    """(fp64 reference, bound on |w| |x| per output) for what `path` computes: x quantized
    per chunk on the dot path; weights rounded to bf16 where the build multiplies bf16
    (not INT8's where a kernel multiplies its integers, exact in bf16, and scales the sum:
    the prefill path's tiles hold integer x scale, rounded; not on the gemm path, which
    widens x and dequantizes W to fp32 panels at every level)."""
    w = torch.from_numpy(w_ref).double()
    k = w.shape[1]
    if path in ("dot", "amx_dot"):
        q, d = kernels.quantize_activations(x)
        xs = (q[:, :k].double() * d.double().repeat_interleave(32, dim=1)[:, :k])
    else:
        xs = x.double()
        if (x.dtype == torch.bfloat16 and (kernels.has_bf16 or path == "amx")
                and path != "gemm" and (weight.format.name != "INT8" or path == "prefill")):
            w = w.float().to(torch.bfloat16).double()
    ref = xs @ w.T + (0 if bias is None else bias.double())
    return ref, xs.abs() @ w.abs().T


def assert_matches(y, ref, bound):
    err = (y.double() - ref).abs()
    tol = 1e-5 * bound + 1e-30
    if y.dtype == torch.bfloat16:
        tol = tol + 2 ** -8 * ref.abs()
        # fp32 accumulation, then round-to-nearest-even: nearly all outputs are the
        # correctly rounded result.
        assert (y != ref.to(torch.bfloat16)).float().mean() < 0.02
    assert (err <= tol).all(), f"max excess {(err - tol).max().item():.3g}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_gemv_paths_match_reference(kernels, fmt):
    gen = torch.Generator().manual_seed(7)
    for i, (n, k) in enumerate(SHAPES[fmt]):
        weight, w_ref = make_weight(fmt, n, k, seed=10 + i, kernels=kernels)
        bias = torch.randn(n, generator=gen) if i % 2 else None
        for m in ROWS:
            for dtype in (torch.bfloat16, torch.float32):
                x = torch.randn(m, k, generator=gen).to(dtype)
                paths = ["dot", "deq", "deq_buffered"]
                if kernels.has_amx:
                    paths += ["amx_dot"] + (["amx"] if dtype == torch.bfloat16 else [])
                if kernels.has_gemm and dtype == torch.bfloat16:
                    paths += ["gemm"]
                for path in paths:
                    y = kernels.gemv(fmt, weight.blocks, weight.scales, k, x, bias, path)
                    assert y.dtype == dtype and y.shape == (m, n)
                    assert_matches(y, *_reference(kernels, path, weight, w_ref, x, bias))
                if fmt in kernels.r16_formats:  # the same activations as dot, other layout
                    y = kernels.gemv_r16(fmt, weight.packed, weight.scales, n, k, x, bias)
                    assert y.dtype == dtype and y.shape == (m, n)
                    assert_matches(y, *_reference(kernels, "dot", weight, w_ref, x, bias))


@pytest.mark.parametrize("fmt", ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "INT8"))
@pytest.mark.parametrize("invariant", (False, True), ids=("default", "batch_invariant"))
def test_one_copy_of_a_weight_where_r16_runs_at_every_row_count(kernels, fmt, invariant):
    """Where the r16 path runs at every row count the GGUF blocks are not kept beside the
    r16 copy: `blocks` unpacks them byte for byte, the weight's bytes are the copy's, and
    the products are unchanged. Elsewhere both are kept. (Batch-invariant kernels take
    r16 at every row count wherever it is built: the avx2 build, on any x86 test CPU.)"""
    import copy

    if invariant:
        kernels = copy.copy(kernels)
        kernels.batch_invariant = True
    every = r16_at_every_row_count(kernels, fmt)
    assert every == (fmt in kernels.r16_formats and (invariant or (kernels.has_vnni
                                                                  and not kernels.has_amx)))
    gen = torch.Generator().manual_seed(3)
    for i, (n, k) in enumerate(SHAPES[fmt]):
        weight, w_ref = make_weight(fmt, n, k, seed=40 + i, kernels=kernels)
        as_made, _ = make_weight(fmt, n, k, seed=40 + i)  # no kernels: the blocks as made
        assert (weight.stored_blocks is None) == every
        assert torch.equal(weight.blocks, as_made.blocks)
        if fmt in kernels.r16_formats:
            assert torch.equal(kernels.r16_unpack(fmt, weight.packed, n, k, as_made.row_bytes),
                               as_made.blocks)
            if fmt == "Q4_K":  # 16 rows' 8 sub-blocks: 8 x (256 + 32) bytes, d, dmin 64
                assert weight.packed.numel() == (n + 15) // 16 * k // 256 * 2368
        stored = 0 if every else as_made.blocks.numel()
        packed = 0 if weight.packed is None else weight.packed.numel()
        scales = 0 if weight.scales is None else weight.scales.numel() * 4
        assert weight.nbytes == stored + packed + scales
        for m in (1, 17, 200):
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            path = weight.path(m)
            y = weight.apply(x)
            assert_matches(y, *_reference(kernels, "dot" if path == "r16" else path, weight,
                                          w_ref, x, None))


def test_gemm_runs_wherever_a_vector_unit_does(kernels, request):
    """The fused dequantizing GEMM is built at every AVX2 and AVX-512 level and refuses
    fp32 input; the scalar build has none."""
    name = request.node.callspec.params["kernels"]
    assert kernels.has_gemm == (name != "scalar" and kernels.isa != "scalar")
    weight, _ = make_weight("Q8_0", 20, 64, seed=2, kernels=kernels)
    if kernels.has_gemm:
        with pytest.raises(ValueError, match="bfloat16"):
            kernels.gemv("Q8_0", weight.blocks, None, 64, torch.randn(3, 64), None, "gemm")


def test_r16_runs_where_avx512_vnni_or_plain_avx2_does(kernels, request):
    """The repacked path exists exactly on the AVX-512 VNNI builds and the AVX2 builds
    without VNNI (pmaddubsw on 8-row halves); elsewhere the weight keeps no second copy
    and the path rule never picks it."""
    name = request.node.callspec.params["kernels"]
    expected = {"avx512-bf16": True, "avx512-vnni": True, "avx512f": False,
                "avx2-vnni": False, "avx2": True, "scalar": False}
    if name in expected:
        assert kernels.has_r16 == expected[name]
    weight, _ = make_weight("Q4_0", 20, 64, seed=2, kernels=kernels)
    assert (weight.packed is not None) == kernels.has_r16
    if kernels.has_r16:
        assert weight.packed.numel() == 2 * 2 * 288  # two groups of 16 rows, 2 chunks each
        assert kernels.r16_formats == ("Q8_0", "Q4_0", "Q4_1", "INT8", "Q4_K")
        with pytest.raises(QuantKernelError, match="Q4_K with K=64"):
            kernels.r16_pack("Q4_K", weight.blocks, 64)  # a super-block is 256 values
        with pytest.raises(ValueError, match="r16_pack"):
            kernels.gemv_r16("Q4_0", weight.packed[:-1], None, 20, 64, torch.randn(1, 64), None)
        with pytest.raises(ValueError, match="gemv_r16"):
            kernels.gemv("Q4_0", weight.blocks, None, 64, torch.randn(1, 64), None, "r16")


def test_strided_input_rows(kernels):
    weight, w_ref = make_weight("Q8_0", 40, 256, seed=3, kernels=kernels)
    wide = torch.randn(5, 300).to(torch.bfloat16)
    x = wide[:, 20:276]  # rows 300 apart
    paths = ["dot", "deq", "deq_buffered"] + (["amx", "amx_dot"] if kernels.has_amx else [])
    paths += ["gemm"] if kernels.has_gemm else []
    for path in paths:
        y = kernels.gemv("Q8_0", weight.blocks, None, 256, x, None, path)
        assert torch.equal(y, kernels.gemv("Q8_0", weight.blocks, None, 256, x.contiguous(),
                                           None, path))
        assert_matches(y, *_reference(kernels, path, weight, w_ref, x, None))
    if kernels.has_r16:
        y = kernels.gemv_r16("Q8_0", weight.packed, None, 40, 256, x, None)
        assert torch.equal(y, kernels.gemv_r16("Q8_0", weight.packed, None, 40, 256,
                                               x.contiguous(), None))
        assert_matches(y, *_reference(kernels, "dot", weight, w_ref, x, None))


def test_activation_quantizer(kernels):
    """Per 32-element chunk: d = amax / 127, q = round(x * 127 / amax) to nearest even."""
    gen = torch.Generator().manual_seed(5)
    for k in (32, 100, 576):
        x = torch.randn(7, k, generator=gen) * torch.rand(7, 1, generator=gen) * 10
        x[3, :40] = 0.0  # an all-zero chunk: d = 0, q = 0
        for xin in (x, x.to(torch.bfloat16)):
            q, d = kernels.quantize_activations(xin)
            kp = (k + 63) // 64 * 64
            padded = torch.zeros(7, kp)
            padded[:, :k] = xin.float()
            chunks = padded.view(7, -1, 32)
            amax = chunks.abs().amax(dim=2)
            inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
            assert torch.equal(d, amax / 127.0)
            assert torch.equal(q.view(7, -1, 32), torch.round(chunks * inv[..., None]).to(torch.int8))


def test_threads_do_not_change_results(kernels):
    weight, _ = make_weight("Q4_1", 333, 512, seed=4, kernels=kernels)
    x = torch.randn(9, 512).to(torch.bfloat16)
    paths = ["dot", "deq", "deq_buffered"] + (["amx", "amx_dot"] if kernels.has_amx else [])
    paths += ["gemm"] if kernels.has_gemm else []
    for path in paths:
        one = kernels.gemv("Q4_1", weight.blocks, None, 512, x, None, path, threads=1)
        assert torch.equal(kernels.gemv("Q4_1", weight.blocks, None, 512, x, None, path,
                                        threads=2), one)
    if kernels.has_r16:
        one = kernels.gemv_r16("Q4_1", weight.packed, None, 333, 512, x, None, threads=1)
        assert torch.equal(kernels.gemv_r16("Q4_1", weight.packed, None, 333, 512, x, None,
                                            threads=2), one)


@pytest.mark.parametrize("fmt", ("Q8_0", "INT8", "Q4_0", "Q4_1", "Q4_K"))
def test_r16_rows_do_not_depend_on_the_batch(kernels, fmt):
    """A row's r16 output is the same bits whatever rows beside it: the AVX-512 build runs
    two 16-row groups at a time from 9 rows on (Q8_0, INT8) or 32 (the Q4 formats, their
    nibbles unpacked once per pair) (quant_r16.c, r16_group2), and a thread's last group
    alone when its share is odd (21 groups here, split 10 / 11 over two threads);
    batch-invariant engines rely on it."""
    if not kernels.has_r16:
        pytest.skip(f"{kernels.isa} has no r16 path (test_r16_runs_where_... names where)")
    weight, _ = make_weight(fmt, 333, 512, seed=5, kernels=kernels)
    gen = torch.Generator().manual_seed(3)
    bias = torch.randn(333, generator=gen)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(45, 512, generator=gen).to(dtype)
        alone = torch.cat([kernels.gemv_r16(fmt, weight.packed, weight.scales, 333, 512,
                                            x[m:m + 1], bias) for m in range(45)])
        for m in (8, 9, 23, 31, 32, 45):
            for threads in (1, 2):
                y = kernels.gemv_r16(fmt, weight.packed, weight.scales, 333, 512, x[:m], bias,
                                     threads=threads)
                assert torch.equal(y, alone[:m]), (dtype, m, threads)


def test_kernels_refuse_inconsistent_shapes(kernels):
    weight, _ = make_weight("Q8_0", 8, 64, seed=1, kernels=kernels)
    x = torch.randn(2, 48).to(torch.bfloat16)
    for path in ("dot", "deq"):
        with pytest.raises(QuantKernelError, match="K=48"):
            kernels.gemv("Q8_0", weight.blocks, None, 48, x, None, path)
    with pytest.raises(QuantKernelError):
        kernels.dequantize("Q4_K", weight.blocks, None, 64)  # 64 is not a Q4_K row
    with pytest.raises(ValueError, match="rows"):
        kernels.dequantize("Q8_0", weight.blocks, None, 64, rows=(2, 9))
    with pytest.raises(ValueError, match="path"):
        kernels.gemv("Q8_0", weight.blocks, None, 64, torch.randn(1, 64), None, "fast")
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        kernels.gemv("Q8_0", weight.blocks, None, 64, torch.randn(1, 64).half(), None, "dot")
    with pytest.raises(ValueError, match="unit stride"):
        kernels.gemv("Q8_0", weight.blocks, None, 64, torch.randn(64, 2).t(), None, "dot")
    with pytest.raises(ValueError, match="bias"):
        kernels.gemv("Q8_0", weight.blocks, None, 64, torch.randn(1, 64), torch.zeros(8).half())
    with pytest.raises(ValueError, match="contiguous uint8"):
        kernels.gemv("Q8_0", weight.blocks.t(), None, 64, torch.randn(1, 64), None)


def test_amx_path_only_where_available(kernels):
    weight, _ = make_weight("Q8_0", 8, 64, seed=2, kernels=kernels)
    if kernels.has_amx:
        with pytest.raises(ValueError, match="bfloat16"):
            kernels.gemv("Q8_0", weight.blocks, None, 64, torch.randn(1, 64), None, "amx")
    else:
        assert "amx" not in kernels.isa
        for path in ("amx", "amx_dot"):
            with pytest.raises(ValueError, match="AMX"):
                kernels.gemv("Q8_0", weight.blocks, None, 64, torch.randn(1, 64).bfloat16(),
                             None, path)


def test_gguf_type_numbers_match_the_gguf_package():
    import gguf

    from treadle.models.quant_formats import FORMATS as TABLE

    for name, fmt in TABLE.items():
        if fmt.ggml_type is not None:
            qtype = gguf.GGMLQuantizationType(fmt.ggml_type)
            assert qtype.name == name
            assert gguf.GGML_QUANT_SIZES[qtype] == (fmt.block_elems, fmt.block_bytes)


def test_random_q4k_blocks_are_what_gguf_dequantizes():
    """The Q4_K test data (random bytes) round-trips through gguf's reader layout."""
    weight, ref = make_weight("Q4_K", 3, 512, seed=9)
    assert np.isfinite(ref).all() and ref.std() > 0
    assert torch.equal(weight.dequantize(), torch.from_numpy(ref)) or torch.allclose(
        weight.dequantize(), torch.from_numpy(ref), rtol=3e-7, atol=1e-9)


def test_quant_kernel_benchmark_measures_every_path(tmp_path, monkeypatch):
    """bench/quant_kernel.py runs (its figures set choose_path's thresholds) and reports a
    time for each quantized path and the dense kernels it compares them with."""
    from benchmarks import quant_kernel

    (row,) = quant_kernel.gemv(rows=(2,), formats=("Q8_0",), shapes=("kv",), repeats=1,
                               copies_per_layer=1)
    assert row["shape"] == "kv" and row["m"] == 2
    labels = set(row["kernels"])
    assert {"onednn_linear", "Q8_0_dot", "Q8_0_deq_buffered"} <= labels
    # oneDNN's packed bf16 kernel is timed where it exists (not on an AVX2-only CPU).
    assert ("onednn_packed" in labels) == packed_kernel_works(torch.bfloat16)
    assert all(v["ms"] > 0 for v in row["kernels"].values())
