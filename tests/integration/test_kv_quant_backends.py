"""Quantized KV caches (worker/kv_quant.py) in every backend that reads them, against the
`reference` backend on the same step: the K/V written must be bit-identical (rope_kv's
C quantization is the torch one), outputs equal up to the kernels' rounding. Plus the
format itself: error bounds, zero rows, scales beside their values through block copies."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from treadle.worker import kv_quant
from treadle.layers.attention import AttentionLayer
from treadle.worker.attention_backends import make_attention_backend
from treadle.worker.kv_cache import KVCacheSpec, allocate_kv_caches, allocate_swap_space, copy_blocks
from treadle.worker.cpu.platform import CPU

from test_attention_backends import (BLOCK_SIZE, NUM_BLOCKS, STEPS, backend, make_step,
                                      rotary_for)


def quantized_backend(name, kv_heads, head_dim, dtype, kind):
    from treadle.worker.cpu.native import load_kernels
    from treadle.worker.cpu.native_linear import NativeLayerOps
    kernels = load_kernels()
    ops = NativeLayerOps.load(kernels.lib) if kernels is not None else None
    return make_attention_backend(name, CPU, kv_heads, head_dim, dtype, kernels=kernels,
                                  layer_ops=ops if dtype == torch.bfloat16 else None,
                                  kv_cache_dtype=kind)


@pytest.mark.parametrize("name, kind", [("cpu-native", "int8"), ("torch", "int8"),
                                        ("torch", "fp8_e4m3")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 64), (8, 1, 128), (3, 3, 24),
                                                       (9, 3, 64)])
@pytest.mark.parametrize("case", sorted(STEPS))
def test_quantized_backend_matches_reference(name, kind, dtype, heads, kv_heads, head_dim,
                                             case):
    rng = np.random.default_rng(zlib.crc32(f"q{heads}-{kv_heads}-{head_dim}-{case}".encode()))
    step, positions = make_step(rng, STEPS[case])
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    dense = torch.randn(2, kv_heads, NUM_BLOCKS, BLOCK_SIZE, head_dim, generator=gen)
    cache0 = kv_quant.quantize(dense, kind)
    qk = torch.randn(step.num_tokens, heads + kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(step.num_tokens, kv_heads, head_dim, generator=gen).to(dtype)
    rotary = rotary_for(positions, head_dim, dtype)
    layer = AttentionLayer(heads, kv_heads, head_dim, head_dim ** -0.5)
    results = {}
    for which in ("reference", name):
        impl = quantized_backend(which, kv_heads, head_dim, dtype, kind)
        cache = cache0.clone()
        meta = impl.build_metadata(step, torch.device("cpu"))
        results[which] = (layer(qk, value, cache, meta, rotary).float(), cache)
    (ref_out, ref_cache), (out, cache) = results["reference"], results[name]
    assert torch.equal(cache, ref_cache)  # quantized values and scales, bit for bit
    # The reference dequantizes in fp32; the prefill kernel packs dequantized bf16.
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    if name == "cpu-native" and dtype == torch.bfloat16:
        tol = dict(atol=4e-2, rtol=4e-2)
    torch.testing.assert_close(out, ref_out, **tol)


def test_quantized_reference_attends_to_dequantized_values():
    """The quantized reference is the dense reference run on a cache holding the
    dequantized values (so the quantized kernels, matching it, read those values)."""
    rng = np.random.default_rng(3)
    step, positions = make_step(rng, STEPS["mixed"])
    heads, kv_heads, d = 4, 2, 64
    gen = torch.Generator().manual_seed(5)
    rows = kv_quant.quantize(torch.randn(2, kv_heads, NUM_BLOCKS, BLOCK_SIZE, d, generator=gen),
                             "int8")
    qk = torch.randn(step.num_tokens, heads + kv_heads, d, generator=gen)
    value = torch.randn(step.num_tokens, kv_heads, d, generator=gen)
    layer = AttentionLayer(heads, kv_heads, d, 0.125)
    rotary = rotary_for(positions, d, torch.float32)
    q_impl = quantized_backend("reference", kv_heads, d, torch.float32, "int8")
    out_q = layer(qk, value, rows, q_impl.build_metadata(step, "cpu"), rotary)
    # the same step on a dense cache: dequantized old context, new K/V quantized by hand
    dense = kv_quant.dequantize(rows, "int8")
    impl = backend("reference", kv_heads, d, torch.float32)
    key = rotary.apply(qk)[:, heads:]
    k_dq = kv_quant.dequantize(kv_quant.quantize(key, "int8"), "int8")
    v_dq = kv_quant.dequantize(kv_quant.quantize(value, "int8"), "int8")
    qk_dq = torch.cat((rotary.apply(qk)[:, :heads], k_dq), 1)
    out = layer(qk_dq, v_dq, dense, impl.build_metadata(step, "cpu"), None)
    torch.testing.assert_close(out_q, out, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out, layer(rotary.apply(qk).clone(), value, kv_quant.dequantize(
        rows, "int8"), impl.build_metadata(step, "cpu"), None), atol=1e-4)


@pytest.mark.parametrize("kind, rel", [("int8", 0.5 / 127), ("fp8_e4m3", 1 / 16)])
def test_quantization_error_is_bounded(kind, rel):
    x = torch.randn(64, 3, 64, generator=torch.Generator().manual_seed(0)) * 10
    x[0, 0] = 0  # a zero row: scale 0, zeros back
    rows = kv_quant.quantize(x, kind)
    assert rows.shape == (64, 3, 66) and rows.dtype == kv_quant.STORAGE_DTYPES[kind]
    back = kv_quant.dequantize(rows, kind)
    amax = x.abs().amax(-1, keepdim=True)
    if kind == "int8":  # half a step of max|x| / 127
        assert ((back - x).abs() <= amax * rel * (1 + 1e-3)).all()  # fp16 scale
    else:  # 3 mantissa bits: relative error <= 2^-4 above the subnormals
        assert ((back - x).abs() <= x.abs() * rel + amax * 2 ** -9 / 448 * 8).all()
    assert torch.equal(back[0, 0], torch.zeros(64))
    assert torch.equal(kv_quant.scales(rows)[0, 0], torch.zeros(1))
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_quant.check_kv_cache_dtype("int4")


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
def test_swap_round_trips_values_and_scales(kind):
    """A block copied out to swap space and back (the swap path's copy_blocks) comes back
    bit-identical, scales included: they live in the block's rows."""
    spec = KVCacheSpec(3, 2, 64, torch.bfloat16, "heads_first", kind)
    assert spec.bytes_per_token == 2 * 3 * 2 * 66
    caches = allocate_kv_caches(spec, 8, 4)
    gen = torch.Generator().manual_seed(1)
    for c in caches:
        c.copy_(kv_quant.quantize(torch.randn(c.shape[:-1] + (64,), generator=gen), kind))
    before = [c.clone() for c in caches]
    swap = allocate_swap_space(spec, 4, 4)
    assert copy_blocks(caches, swap, [(5, 0), (2, 3)], spec.block_dim) == 3 * 2 * 2 * 2 * 4 * 66
    for c in caches:
        c[:, :, [5, 2]] = 0
    copy_blocks(swap, caches, [(0, 5), (3, 2)], spec.block_dim)
    for c, b in zip(caches, before):
        assert torch.equal(c, b)


def test_backends_refuse_formats_they_cannot_read():
    with pytest.raises(ValueError, match="fp8_e4m3"):
        quantized_backend("cpu-native", 2, 64, torch.bfloat16, "fp8_e4m3")
    with pytest.raises(ValueError, match="int8"):
        make_attention_backend("triton", CPU, 2, 64, torch.bfloat16, kv_cache_dtype="int8")
    assert quantized_backend("auto", 2, 64, torch.bfloat16, "fp8_e4m3").name == "torch"



def _levels():
    from treadle.worker.cpu.cpu_isa import executable_levels
    return executable_levels() or ["native"]


@pytest.fixture(scope="module", params=_levels())
def level_kernels(request):
    from treadle.worker.cpu.native import load_kernels
    k = load_kernels(request.param)
    assert k is not None, "the C kernels must build on the test machine (gcc is required)"
    return k


def _dense_reference(q, kd, vd, table, ctx_lens, scale):
    """softmax(q k^T) v per request over dequantized K/V [kv_heads, blocks, bs, d]."""
    num_reqs, num_heads, d = q.shape
    kvh, bs = kd.shape[0], kd.shape[2]
    out = torch.empty(q.shape, dtype=torch.float32)
    for r in range(num_reqs):
        n = int(ctx_lens[r])
        blocks = table[r, :(n + bs - 1) // bs]
        k = kd[:, blocks].reshape(kvh, -1, d)[:, :n]
        v = vd[:, blocks].reshape(kvh, -1, d)[:, :n]
        qq = q[r].view(kvh, num_heads // kvh, d).float()
        out[r] = (torch.softmax(qq @ k.transpose(1, 2) * scale, -1) @ v).reshape(num_heads, d)
    return out


# (requests, heads, kv heads, head_dim, block size, longest context): fast paths (64/128,
# groups 1..8, short blocks, a context split across threads) and the generic loops (24).
DECODE_SHAPES = [(5, 9, 3, 64, 16, 300), (3, 8, 1, 128, 16, 100), (2, 4, 4, 64, 5, 37),
                 (1, 4, 2, 64, 16, 3000), (3, 6, 2, 24, 16, 70)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", DECODE_SHAPES)
def test_int8_decode_kernel_reads_dequantized_values(level_kernels, shape, dtype):
    num_reqs, heads, kvh, d, bs, longest = shape
    gen = torch.Generator().manual_seed(sum(shape))
    ctx = torch.randint(1, longest + 1, (num_reqs,), generator=gen)
    ctx[0] = longest
    need = (ctx + bs - 1) // bs
    num_blocks = int(need.sum()) + 3
    table = torch.zeros(num_reqs, int(need.max()), dtype=torch.int64)
    perm = torch.randperm(num_blocks, generator=gen)
    at = 0
    for r in range(num_reqs):
        table[r, :need[r]] = perm[at:at + need[r]]
        at += int(need[r])
    rows = kv_quant.quantize(torch.randn(2, kvh, num_blocks, bs, d, generator=gen), "int8")
    q = torch.randn(num_reqs, heads, d, generator=gen).to(dtype)
    out = torch.empty_like(q)
    scale = d ** -0.5
    level_kernels.paged_decode(q, rows[0].contiguous(), rows[1].contiguous(), table, ctx, out,
                               scale)
    dq = kv_quant.dequantize(rows, "int8")
    expected = _dense_reference(q, dq[0], dq[1], table, ctx, scale)
    tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), expected, **tol)


@pytest.mark.parametrize("amx", [False, True], ids=["vector", "amx"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_int8_prefill_kernel_reads_dequantized_values(level_kernels, head_dim, amx):
    """On the vector kernels and, where it exists, the AMX compute path (its twin
    elsewhere: the vector case)."""
    if not level_kernels.supports_prefill(torch.bfloat16, head_dim):
        pytest.skip("no prefill kernel in this build")
    if amx and not level_kernels.supports_amx_prefill(head_dim):
        pytest.skip("no AMX compute path here")
    heads, kvh, bs = 6, 2, 16
    gen = torch.Generator().manual_seed(head_dim)
    spans = torch.tensor([[0, 40, 0], [40, 17, 75]], dtype=torch.int64)  # cached prefix
    num_blocks = 12
    table = torch.stack([torch.randperm(num_blocks, generator=gen)[:6] for _ in range(2)])
    rows = kv_quant.quantize(torch.randn(2, kvh, num_blocks, bs, head_dim, generator=gen),
                             "int8")
    q = torch.randn(57, heads, head_dim, generator=gen).to(torch.bfloat16)
    out = torch.zeros(57, heads * head_dim, dtype=torch.bfloat16)
    ws = level_kernels.prefill_workspace(spans, kvh, head_dim)
    scale = head_dim ** -0.5
    level_kernels.paged_prefill(q, rows[0].contiguous(), rows[1].contiguous(), spans, table,
                                out, ws, scale, amx=amx)
    # the kernel packs dequantized values rounded to bf16: so does the expectation
    dq = kv_quant.dequantize(rows, "int8").to(torch.bfloat16).float()
    for first, n, start in spans.tolist():
        ctx = start + n
        s = int((spans[:, 0] == first).nonzero())
        k = dq[0][:, table[s]].reshape(kvh, -1, head_dim)[:, :ctx]
        v = dq[1][:, table[s]].reshape(kvh, -1, head_dim)[:, :ctx]
        qq = q[first:first + n].float().transpose(0, 1)  # [heads, n, d]
        k, v = k.repeat_interleave(heads // kvh, 0), v.repeat_interleave(heads // kvh, 0)
        scores = qq @ k.transpose(1, 2) * scale
        mask = torch.arange(ctx)[None, :] <= torch.arange(start, ctx)[:, None]
        o = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v
        torch.testing.assert_close(out[first:first + n].float(),
                                   o.transpose(0, 1).reshape(n, -1), atol=2e-2, rtol=2e-2)
