"""The small-batch bf16 C kernels (worker/cpu/native_linear.py) against torch: the linear layer
against F.linear in float32 rounded to bf16, the fused residual-add + RMSNorm and
silu * mul against the model's torch code, the fallbacks, and an engine whose bf16 model
runs them against the same engine on torch alone. Every test runs once per kernel ISA level
this CPU executes (avx512bf16, avx512, avx2: worker/cpu/cpu_isa.py), so the widening kernels of
CPUs without AVX-512 BF16 are tested on a machine that has it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from treadle.models.llama import rms_norm
from treadle.worker.cpu.linear_kernels import DenseLinearKernel, dense_kernel_factory
from treadle.worker.cpu.native import load_kernels
from treadle.worker.cpu.native_linear import (AMX_MAX_ROWS, MAX_ROWS, WIDENING_GEMM_ROWS,
                                         WIDENING_MAX_ROWS,
                                         NativeLayerOps, onednn_uses_amx)

@pytest.fixture(scope="module")
def level(kernel_level) -> str:
    return kernel_level


@pytest.fixture(scope="module")
def ops(level, level_kernels):
    kernels = level_kernels
    # The tests below sweep every row count up to max_rows: the first 16 at every level
    # (test_linear_any_row_count covers the levels' larger defaults).
    layer_ops = NativeLayerOps.load(kernels.lib, max_rows=16)
    if layer_ops is None:
        pytest.skip(f"the {level} build has no vector unit (neither AVX-512 nor AVX2)")
    return layer_ops


def reference(x, w, b):
    return F.linear(x.float(), w.float(), None if b is None else b.float())


def assert_bf16_close(got: torch.Tensor, ref32: torch.Tensor) -> None:
    """Within one bf16 rounding of the float32 result (plus float32 summation slack)."""
    assert got.dtype == torch.bfloat16 and got.shape == ref32.shape
    torch.testing.assert_close(got.float(), ref32, rtol=2 ** -8, atol=1e-3)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n, k", [(1, 1), (5, 31), (17, 33), (49, 100), (960, 576),
                                  (576, 1536), (100, 577)])
def test_linear_matches_float32_reference(ops, n, k, bias):
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
    for m in range(1, ops.max_rows + 1):
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        ref = reference(x, w, b)
        got = ops.linear(x, w, b)
        assert_bf16_close(got, ref)
        # fp32 accumulation and round-to-nearest-even: almost every output is the
        # correctly rounded float32 result.
        assert (got != ref.to(torch.bfloat16)).float().mean() < 0.01


def test_linear_any_row_count(level):
    """Without vdpbf16ps the kernel takes every row count by default (torch's bf16 linear
    is the slow path there), with the same accuracy at prefill-sized batches."""
    kernels = load_kernels(level)
    ops = NativeLayerOps.load(kernels.lib)
    if ops is None:
        pytest.skip(f"the {level} build has no vector unit (neither AVX-512 nor AVX2)")
    assert ops.max_rows == (WIDENING_MAX_ROWS if not kernels.has_dpbf16 else
                            AMX_MAX_ROWS if onednn_uses_amx() else MAX_ROWS)
    ops = NativeLayerOps.load(kernels.lib, max_rows=WIDENING_MAX_ROWS)
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(203, 577, generator=gen).to(torch.bfloat16)
    b = torch.randn(203, generator=gen).to(torch.bfloat16)
    for m in (17, 64, 333, 1030):
        x = torch.randn(m, 577, generator=gen).to(torch.bfloat16)
        got, ref = ops.linear(x, w, b), reference(x, w, b)
        assert_bf16_close(got, ref)
        assert (got != ref.to(torch.bfloat16)).float().mean() < 0.01


def test_packed_gemm_matches_float32_reference(ops):
    """The packed vdpbf16ps GEMM (gemm_bf16_vnni.c) at every row count it takes (each of
    its tilings: 8 x 3 and 12 x 2 register tiles, row tiles split evenly, a last row
    block of 9 rows after 128): N not a multiple of its 16-column groups or 32/48-column
    tiles, K odd, strided x rows whose neighbours past K are NaN (never read into a sum),
    with and without bias."""
    if not ops.vnni:
        pytest.skip("the packed GEMM runs with vdpbf16ps and without AMX in oneDNN")
    gen = torch.Generator().manual_seed(11)
    for n, k in [(1, 1), (5, 31), (17, 33), (50, 100), (100, 577), (960, 576), (576, 1536)]:
        w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
        b = torch.randn(n, generator=gen).to(torch.bfloat16)
        packed = ops.pack(w)
        assert packed.numel() == (n + 15) // 16 * 16 * (k + k % 2)
        for m in (*range(1, 26), 64, 129, 137, 300):
            wide = torch.randn(m, k + 3, generator=gen).to(torch.bfloat16)
            wide[:, k:] = float("nan")
            x = wide[:, :k]
            for bias in (None, b):
                got, ref = ops.linear(x, w, bias, packed=packed), reference(x, w, bias)
                assert_bf16_close(got, ref)
                assert (got != ref.to(torch.bfloat16)).float().mean() < 0.01
                assert torch.equal(ops.linear(x.contiguous(), w, bias, packed=packed, threads=1),
                                   got)


def test_packed_argmax_is_the_first_largest_output(ops):
    """gemm_bf16_vnni_argmax (the LM head of an all-greedy step) gives, per row, the first
    column of the largest value the packed GEMM writes, bias included, and
    gemm_bf16_vnni_f32 (the LM head's float32 logits) those values exactly: shapes off its
    16-column groups and 48-column tiles, K odd, rows past one 128-row block, one and two
    threads, exact ties (repeated weight rows, the lower column wins, also across the
    threads' shares), the first `columns` only, and -1 for a row of NaNs."""
    if not ops.vnni:
        pytest.skip("the packed GEMM runs with vdpbf16ps and without AMX in oneDNN")
    gen = torch.Generator().manual_seed(13)
    for n, k in [(1, 1), (5, 31), (17, 33), (50, 100), (100, 577), (3001, 64)]:
        w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
        if n > 40:  # rows in another tile and in the other thread's half repeat row 3
            w[n - 1] = w[3]
            w[40] = w[3]
            w[3] *= 4  # so that row 3 wins for many x rows, tied with its copies
            w[n - 1], w[40] = w[3], w[3]
        b = torch.randn(n, generator=gen).to(torch.bfloat16)
        if n > 40:
            b[n - 1], b[40] = b[3], b[3]
        packed = ops.pack(w)
        for m in (*range(1, 14), 17, 25, 64, 129, 137, 300):
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            for bias in (None, b):
                y = ops.linear(x, w, bias, packed=packed).float()
                for threads in (0, 1):
                    got = ops.argmax(x, w, bias, packed, threads=threads)
                    assert torch.equal(got, y.argmax(dim=1)), (n, k, m, threads)
                    as_float = ops.linear_float(x, w, bias, packed, threads=threads)
                    assert as_float.dtype == torch.float32 and torch.equal(as_float, y)
                columns = max(1, n - 7)
                assert torch.equal(ops.argmax(x, w, bias, packed, columns=columns),
                                   y[:, :columns].argmax(dim=1))
        if n > 40:
            assert (y.argmax(dim=1) == 3).any()  # the ties above were exercised
    x = torch.randn(3, 100, generator=gen).to(torch.bfloat16)
    x[1, 7] = float("nan")
    w = torch.randn(50, 100, generator=gen).to(torch.bfloat16)
    got = ops.argmax(x, w, None, ops.pack(w))
    assert got[1] == -1
    assert torch.equal(got[[0, 2]], ops.linear(x, w, None, packed=ops.pack(w))[[0, 2]]
                       .float().argmax(dim=1))
    assert ops.argmax(x, w, None, None) is None  # no packed copy: not this kernel's call
    assert ops.linear_float(x, w, None, None) is None


def test_layer_kernels_take_the_packed_copy(ops):
    """Where the packed GEMM runs, a layer's kernel holds its packed copy instead of
    oneDNN's, runs every row count on it, and makes oneDNN's copy only when a call falls
    back to torch."""
    if not ops.vnni:
        pytest.skip("the packed GEMM runs with vdpbf16ps and without AMX in oneDNN")
    gen = torch.Generator().manual_seed(12)
    w = torch.randn(70, 96, generator=gen).to(torch.bfloat16)
    kernel = dense_kernel_factory(torch.bfloat16, ops)(w, None)
    assert kernel.vnni is not None and kernel.packed is None
    for m in (1, 16, 65, 700):
        x = torch.randn(m, 96, generator=gen).to(torch.bfloat16)
        assert torch.equal(kernel(x), ops.linear(x, w, None, packed=kernel.vnni))
    kernel.native = None  # torch's layers (set_layer_kernels(False)): oneDNN, packed now
    x = torch.randn(5, 96, generator=gen).to(torch.bfloat16)
    assert_bf16_close(kernel(x), reference(x, w, None))
    assert kernel.packed is not None


def test_linear_strided_rows_and_threads(ops):
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(7, 300, generator=gen).to(torch.bfloat16)
    x = wide[:, 10:266]  # rows 300 apart
    w = torch.randn(333, 256, generator=gen).to(torch.bfloat16)
    got = ops.linear(x, w, None)
    assert_bf16_close(got, reference(x, w, None))
    assert torch.equal(ops.linear(x, w, None, threads=1), got)
    assert torch.equal(ops.linear(x.contiguous(), w, None, threads=2), got)


def test_linear_falls_back_where_not_covered(ops):
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(40, 64, generator=gen).to(torch.bfloat16)
    too_many = torch.randn(ops.max_rows + 1, 64, generator=gen).to(torch.bfloat16)
    assert ops.linear(too_many, w, None) is None
    assert ops.linear(too_many[:4].float(), w.float(), None) is None
    assert ops.linear(too_many[:4].t().contiguous().t(), w, None) is None  # column-major x
    assert ops.linear(too_many[:4], w.t().contiguous().t(), None) is None  # strided weight
    # The layer's kernel takes the packed / F.linear path then, with the same results.
    kernel = dense_kernel_factory(torch.bfloat16, ops)(w, None)
    for x in (too_many, too_many[:3]):
        got = kernel(x)
        assert_bf16_close(got, reference(x, w, None))
    got = DenseLinearKernel(w.float(), None, None, ops)(too_many.float())
    torch.testing.assert_close(got, reference(too_many, w, None))


@pytest.mark.parametrize("m, h", [(1, 576), (4, 576), (16, 576), (3, 100), (200, 64)])
def test_add_rms_norm_matches_torch(ops, m, h):
    gen = torch.Generator().manual_seed(m * h)
    hidden = (torch.randn(m, h, generator=gen) * 3).to(torch.bfloat16)
    delta = torch.randn(m, h, generator=gen).to(torch.bfloat16)
    weight = torch.randn(h, generator=gen).to(torch.bfloat16)
    expected_hidden = hidden + delta
    expected = rms_norm(expected_hidden, weight, 1e-5)
    got_hidden = hidden.clone()
    got = ops.add_rms_norm(got_hidden, delta, weight, 1e-5)
    assert torch.equal(got_hidden, expected_hidden)
    # Summation order may differ from torch's in the last float bit: rarely one bf16 ulp.
    torch.testing.assert_close(got.float(), expected.float(), rtol=2 ** -7, atol=0)
    assert (got != expected).float().mean() < 0.01
    got = ops.add_rms_norm(got_hidden, None, weight, 1e-5)
    torch.testing.assert_close(got.float(), expected.float(), rtol=2 ** -7, atol=0)
    assert torch.equal(got_hidden, expected_hidden)
    assert ops.add_rms_norm(hidden.float(), None, weight.float(), 1e-5) is None


@pytest.mark.parametrize("m, i", [(1, 1536), (4, 1536), (16, 1536), (3, 37)])
def test_silu_mul_matches_torch(ops, m, i):
    gen = torch.Generator().manual_seed(m + i)
    gate_up = (torch.randn(m, 2 * i, generator=gen) * 4).to(torch.bfloat16)
    expected = F.silu(gate_up[:, :i]) * gate_up[:, i:]
    got = ops.silu_mul(gate_up)
    torch.testing.assert_close(got.float(), expected.float(), rtol=2 ** -7, atol=1e-30)
    assert (got != expected).float().mean() < 0.01
    assert ops.silu_mul(gate_up.float()) is None


@pytest.mark.parametrize("m, heads, kv_heads, head_dim", [(1, 9, 3, 64), (4, 9, 3, 64),
                                                         (100, 8, 2, 128), (5, 4, 2, 24)])
def test_rope_kv_matches_torch_bit_for_bit(ops, m, heads, kv_heads, head_dim):
    """Rotated queries, and keys and values at their slots, exactly as apply_rotary then
    write_kv (the same bf16 roundings); other cache slots untouched."""
    from treadle.layers.rotary import apply_rotary
    from treadle.worker.attention.torch_backend import write_kv

    gen = torch.Generator().manual_seed(m * heads + head_dim)
    # qk and value as the model makes them: views into one fused qkv row.
    qkv = (torch.randn(m, (heads + 2 * kv_heads) * head_dim, generator=gen) * 3).bfloat16()
    qk = qkv[:, :(heads + kv_heads) * head_dim].view(m, heads + kv_heads, head_dim)
    value = qkv[:, (heads + kv_heads) * head_dim:].view(m, kv_heads, head_dim)
    table = torch.randn(50, head_dim, generator=gen).bfloat16()  # [cos | sin] per position
    positions = torch.randint(0, 50, (m,), generator=gen)
    cos, sin = table.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
    slots = torch.randperm(8 * 16, generator=gen)[:m]
    expected_cache = torch.randn(2, kv_heads, 8, 16, head_dim, generator=gen).bfloat16()
    cache = expected_cache.clone()

    q = ops.rope_kv(qk, value, cos, sin, cache, slots)
    rotated = apply_rotary(qk, cos, sin)
    write_kv(expected_cache, rotated[:, heads:], value, slots)
    assert q.is_contiguous() and q.shape == (m, heads, head_dim)
    assert torch.equal(q, rotated[:, :heads])
    assert torch.equal(cache, expected_cache)
    assert ops.rope_kv(qk.float(), value.float(), cos.float(), sin.float(), cache, slots) is None


def test_engine_bf16_decode_matches_torch_path(ops, level, tmp_path_factory):
    """A bf16 engine runs the kernels in every layer and decodes as with torch alone: the
    same greedy tokens and log-probabilities, up to bf16 rounding. (The tiny model's bf16
    logits tie often; a near-tie may flip, after which the continuations differ.)"""
    from conftest import make_tiny_checkpoint

    from treadle.config import EngineConfig
    from treadle.engine.core import EngineCore
    from treadle.request import Request
    from treadle.sampling_params import SamplingParams

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("native-linear"), "qwen2")
    core = EngineCore(EngineConfig.from_options(model=path, dtype="bfloat16",
                                                kv_cache_memory="64MiB", kernel_isa=level))
    worker = core.executor.worker
    assert worker.layer_ops is not None
    prompts = [[5 + 7 * i + j for j in range(9 + 4 * i)] for i in range(5)]

    def generate(native: bool) -> list[list[tuple[int, dict[int, float]]]]:
        worker.set_layer_kernels(native)
        for i, prompt in enumerate(prompts):
            core.add_request(Request(f"{native}-{i}", prompt,
                                     SamplingParams(max_tokens=12, temperature=0.0,
                                                    ignore_eos=True, logprobs=5)))
        steps: dict[str, list] = {}
        while core.has_unfinished_requests():
            for out in core.step():
                (lp,) = out.new_logprobs
                steps.setdefault(out.request_id, []).append(
                    (out.new_token_ids[0], dict(zip(lp.token_ids[1:], lp.logprobs[1:]))))
        return [steps[f"{native}-{i}"] for i in range(len(prompts))]

    native, plain = generate(True), generate(False)
    identical = 0
    for got, expected in zip(native, plain):
        for (token, top), (ref_token, ref_top) in zip(got, expected):
            for t in top.keys() & ref_top.keys():
                assert abs(top[t] - ref_top[t]) < 0.1
            if token != ref_token:
                assert ref_top[ref_token] - ref_top.get(token, float("-inf")) < 0.1
                break
        else:
            identical += 1
    assert identical >= 3


def test_onednn_counts_as_amx_only_where_the_cpu_has_it_and_nothing_caps_it(monkeypatch):
    """Runs on every CPU: the decision is made from torch's report and the environment."""
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    assert not onednn_uses_amx()
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert onednn_uses_amx()
    for cap, expected in (("AVX512_CORE_AMX", True), ("ALL", True), ("AVX2", False),
                          ("avx512_core_bf16", False)):
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
        assert onednn_uses_amx() is expected, cap
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    assert not onednn_uses_amx()  # a torch that cannot say: the general rule


def _amx_gemm(ops):
    fn = ops.lib.gemm_bf16_amx
    fn.argtypes, fn.restype = ops._gemv.argtypes, ops._gemv.restype

    def call(x, w, b, m=None, n=None, k=None):
        m = x.shape[0] if m is None else m
        n = w.shape[0] if n is None else n
        k = x.shape[1] if k is None else k
        y = torch.empty(max(m, 1), max(n, 1), dtype=torch.bfloat16)
        status = fn(x.data_ptr(), x.stride(0), w.data_ptr(),
                    None if b is None else b.data_ptr(), y.data_ptr(), y.shape[1], m, n, k, 0)
        return status, y
    return call


@pytest.mark.parametrize("n, k", [(16, 32), (960, 576), (576, 1536), (3072, 576)])
def test_amx_kernel_matches_float32_reference(ops, n, k):
    """The AMX tile kernel (gemm_bf16_amx.c) at every row count it takes, with and without
    bias, and as `linear` routes those rows to it. Needs AMX-BF16 (the twin below runs
    everywhere)."""
    if ops.amx_rows is None:
        pytest.skip("no AMX-BF16 here (or oneDNN is capped below it)")
    gemm = _amx_gemm(ops)
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16)
    for m in (1, 2, 3, 15, 16, 17, 31, 32, 33, 64):
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        for bias in (None, b):
            status, got = gemm(x, w, bias)
            ref = reference(x, w, bias)
            assert status == 0
            assert_bf16_close(got, ref)
            assert (got != ref.to(torch.bfloat16)).float().mean() < 0.01
        if ops.amx_covers(m, n, k):
            assert torch.equal(ops.linear(x, w, b), gemm(x, w, b)[1])


def test_amx_kernel_strided_rows_and_refusals(ops):
    if ops.amx_rows is None:
        pytest.skip("no AMX-BF16 here (or oneDNN is capped below it)")
    gemm = _amx_gemm(ops)
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(20, 700, generator=gen).to(torch.bfloat16)
    x = wide[:, 7:583]  # rows 700 apart, K = 576
    w = torch.randn(48, 576, generator=gen).to(torch.bfloat16)
    status, got = gemm(x, w, None)
    assert status == 0
    assert_bf16_close(got, reference(x, w, None))
    # Shapes it does not take: K not a multiple of 32, N not of 16.
    assert gemm(x, w, None, k=575)[0] == -1
    assert gemm(x, w, None, n=40)[0] == -1
    # Past 64 rows it takes them 64 at a time (batch-invariant engines run it at every
    # row count): the same bits for a row as in a call of its own.
    many = torch.randn(150, 576, generator=gen).to(torch.bfloat16)
    status, got = gemm(many, w, None)
    assert status == 0
    assert_bf16_close(got, reference(many, w, None))
    assert torch.equal(got[100:101], gemm(many[100:101], w, None)[1])


def test_linear_rows_without_amx_stay_on_the_dot_product_kernel(level_kernels):
    """Twin of the AMX tests for every CPU: with no AMX rows the layer ops never route to
    it, and take exactly the dot-product kernel's rows."""
    ops = NativeLayerOps.load(level_kernels.lib, max_rows=4)
    if ops is None:
        pytest.skip("this build has no vector unit")
    plain = NativeLayerOps(level_kernels.lib, max_rows=4, amx_rows=None)
    assert not plain.amx_covers(8, 960, 576) and plain.linear_rows == 4
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(960, 576, generator=gen).to(torch.bfloat16)
    assert plain.linear(torch.randn(8, 576, generator=gen).to(torch.bfloat16), w, None) is None
    x = torch.randn(3, 576, generator=gen).to(torch.bfloat16)
    assert_bf16_close(plain.linear(x, w, None), reference(x, w, None))
    with_amx = NativeLayerOps(level_kernels.lib, max_rows=4, amx_rows=(2, 32))
    assert with_amx.amx_covers(8, 960, 576) and with_amx.linear_rows == 32
    assert not with_amx.amx_covers(8, 960, 577) and not with_amx.amx_covers(8, 968, 576)
    assert not with_amx.amx_covers(1, 960, 576) and not with_amx.amx_covers(33, 960, 576)


def _widen_gemm(ops):
    fn = ops.lib.gemm_bf16_widen
    fn.argtypes, fn.restype = ops._gemv.argtypes, ops._gemv.restype

    def call(x, w, b, threads=0):
        m, k = x.shape
        n = w.shape[0]
        y = torch.empty(m, n, dtype=torch.bfloat16)
        status = fn(x.data_ptr(), x.stride(0), w.data_ptr(),
                    None if b is None else b.data_ptr(), y.data_ptr(), n, m, n, k, threads)
        return status, y
    return call


@pytest.mark.parametrize("n, k", [(1, 1), (5, 31), (17, 33), (49, 100), (100, 577),
                                  (960, 576), (576, 1536)])
def test_widening_gemm_matches_float32_reference(level_kernels, n, k):
    """The register-tiled GEMM of the levels without bf16 arithmetic (gemm_bf16_widen.c)
    at row counts around its micro-kernel's (6 or 12 rows) and panel's (16 or 32 weight
    rows) edges, with and without bias, on one thread and on OpenMP's default. It is
    built at every level that has a vector unit (the dpbf16 level's engine never routes
    to it), so it runs wherever AVX2 does."""
    ops = NativeLayerOps.load(level_kernels.lib)
    if ops is None:
        pytest.skip("this build has no vector unit")
    gemm = _widen_gemm(ops)
    gen = torch.Generator().manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16)
    for m in (1, 5, 6, 7, 12, 13, 20, 64, 131):
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        for bias in (None, b):
            ref = reference(x, w, bias)
            for threads in (1, 0):
                status, got = gemm(x, w, bias, threads)
                assert status == 0
                assert_bf16_close(got, ref)
                assert (got != ref.to(torch.bfloat16)).float().mean() < 0.01


def test_widening_gemm_strided_rows(level_kernels):
    ops = NativeLayerOps.load(level_kernels.lib)
    if ops is None:
        pytest.skip("this build has no vector unit")
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(45, 700, generator=gen).to(torch.bfloat16)[:, 9:585]  # rows 700 apart
    w = torch.randn(70, 576, generator=gen).to(torch.bfloat16)
    status, got = _widen_gemm(ops)(x, w, None)
    assert status == 0
    assert_bf16_close(got, reference(x, w, None))


def test_linear_routes_batches_to_the_widening_gemm_only_without_bf16_arithmetic(level,
                                                                                  level_kernels):
    """Levels without vdpbf16ps send WIDENING_GEMM_ROWS rows and more to the GEMM and
    fewer to the dot-product kernel (bit for bit what each kernel gives alone); the
    avx512bf16 level never routes there."""
    ops = NativeLayerOps.load(level_kernels.lib)
    if ops is None:
        pytest.skip("this build has no vector unit")
    if level_kernels.has_dpbf16:
        assert ops.gemm_rows is None and not ops.gemm_covers(WIDENING_GEMM_ROWS)
        return
    assert ops.gemm_rows == WIDENING_GEMM_ROWS
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(96, 576, generator=gen).to(torch.bfloat16)
    b = torch.randn(96, generator=gen).to(torch.bfloat16)
    dot = NativeLayerOps(level_kernels.lib, max_rows=WIDENING_MAX_ROWS)
    for m in (WIDENING_GEMM_ROWS - 1, WIDENING_GEMM_ROWS, 70):
        x = torch.randn(m, 576, generator=gen).to(torch.bfloat16)
        expected = _widen_gemm(ops)(x, w, b)[1] if m >= WIDENING_GEMM_ROWS else dot.linear(x, w, b)
        assert ops.gemm_covers(m) == (m >= WIDENING_GEMM_ROWS)
        assert torch.equal(ops.linear(x, w, b), expected)


def test_linear_kernel_bench_times_each_routed_kernel_alone(level, level_kernels):
    """bench/linear_kernel's `dot_*` and `gemm_*` variants are the two kernels a widening
    level routes between, each taking every row count: at a row count the ops send to
    the GEMM, `gemm` gives the ops' result and `dot` the dot-product kernel's; below it,
    the reverse."""
    from benchmarks.linear_kernel import kernel_choices

    ops = NativeLayerOps.load(level_kernels.lib)
    if ops is None:
        pytest.skip("this build has no vector unit")
    choices = kernel_choices(ops, 64)
    if level_kernels.has_dpbf16:
        assert "gemm" not in choices
        assert ("vnni" in choices) == ops.vnni
        if ops.vnni:  # the packed GEMM, as the engine calls it with a weight's packed copy
            gen = torch.Generator().manual_seed(9)
            w = torch.randn(80, 576, generator=gen).to(torch.bfloat16)
            x = torch.randn(30, 576, generator=gen).to(torch.bfloat16)
            packed = ops.pack(w)
            assert torch.equal(choices["vnni"].linear(x, w, None, packed=packed),
                               ops.linear(x, w, None, packed=packed))
            assert torch.equal(choices["dot"].linear(x, w, None),
                               NativeLayerOps(level_kernels.lib, max_rows=64).linear(x, w, None))
        return
    assert set(choices) >= {"dot", "gemm"}
    gen = torch.Generator().manual_seed(10)
    w = torch.randn(80, 576, generator=gen).to(torch.bfloat16)
    dot = NativeLayerOps(level_kernels.lib, max_rows=WIDENING_MAX_ROWS)
    for m in (4, WIDENING_GEMM_ROWS + 4):
        x = torch.randn(m, 576, generator=gen).to(torch.bfloat16)
        assert torch.equal(choices["gemm"].linear(x, w, None), _widen_gemm(ops)(x, w, None)[1])
        assert torch.equal(choices["dot"].linear(x, w, None), dot.linear(x, w, None))
        routed = choices["gemm"] if m >= WIDENING_GEMM_ROWS else choices["dot"]
        assert torch.equal(ops.linear(x, w, None), routed.linear(x, w, None))


def test_read_probe_reads_huge_page_buffers_whole(level_kernels):
    """bench/linear_kernel's read-rate figure from a HugePageArena buffer (where the packed
    weights live) reads every byte: the probe's sum over a buffer of ones is its length."""
    import ctypes

    from benchmarks.linear_kernel import read_bandwidth
    from treadle.worker.cpu.huge_pages import HugePageArena

    fn = level_kernels.lib.read_probe_sum
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int64]
    fn.restype = ctypes.c_uint64
    words = (3 << 20) // 8 + 5
    buf = HugePageArena().empty(words, torch.int64).fill_(1)
    assert fn(buf.data_ptr(), words, 2, 0) == words
    result = read_bandwidth(level_kernels, 4 << 20, repeats=1, prefetch=(0,), huge_pages=True)
    assert result["bytes"] == 4 << 20 and result["best_gb_s"] > 0
