"""The C decode-attention kernel's sliding-window bound and its head_dim 256 fast path
(worker/cpu/kernels/paged_decode.c `paged_decode_*_window`), against attention in float64
over each row's window only, once per kernel ISA level this CPU executes; and the
cpu-native backend's sliding layers on that kernel.

A row with context n and window W attends to positions [max(0, n - W), n). The table
entries of blocks wholly before that are garbage here (-1, ids far past the cache, a
block of NaN), and the cache rows before the window's first position in its first block
are NaN: a kernel that read any of them would fail (NaN in the output) or crash."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from treadle.worker import kv_quant

FAR = 1 << 40  # a block id far past any cache: reading it would fault


def _reference(q, k, v, table, ctx, scale, window):
    """float64 softmax(q k^T) v over each row's window; k, v: [kv_heads, blocks, bs, d]
    (already dequantized)."""
    num_reqs, num_heads, d = q.shape
    kvh, bs = k.shape[0], k.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for r in range(num_reqs):
        n = int(ctx[r])
        first = max(0, n - window) if window else 0
        pos = torch.arange(first, n)
        blocks = table[r, pos // bs]
        kk = k[:, blocks, pos % bs].double()
        vv = v[:, blocks, pos % bs].double()
        qq = q[r].view(kvh, num_heads // kvh, d).double()
        probs = torch.softmax(qq @ kk.transpose(1, 2) * scale, dim=-1)
        out[r] = (probs @ vv).reshape(num_heads, d)
    return out


def _case(head_dim, group, block_size, contexts, window, kind, seed, kv_heads=2):
    """Queries, caches and a table for `contexts` whose pre-window entries are garbage
    and whose pre-window rows in the window's first block are NaN. kind: bf16, f32 or
    int8 (an int8 cache with bf16 queries)."""
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.float32 if kind == "f32" else torch.bfloat16
    num_reqs = len(contexts)
    ctx = torch.tensor(contexts, dtype=torch.int64)
    need = [(n + block_size - 1) // block_size for n in contexts]
    max_blocks = max(need)
    num_blocks = sum(need) + 2
    poison = num_blocks - 1  # a block of NaN that some stale entries name
    table = torch.full((num_reqs, max_blocks + 2), -1, dtype=torch.int64)
    perm = torch.randperm(num_blocks - 1, generator=gen)
    at = 0
    k = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=gen)
    v = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=gen)
    nan_rows = []  # (block, first valid offset) of each window's first block
    for r, n in enumerate(contexts):
        first = max(0, n - window) if window else 0
        fb = first // block_size
        table[r, fb:need[r]] = perm[at:at + need[r] - fb]
        at += need[r] - fb
        table[r, :fb] = torch.tensor([-1, FAR, poison])[torch.arange(fb) % 3]
        if first % block_size:
            nan_rows.append((int(table[r, fb]), first % block_size))
    q = torch.randn(num_reqs, group * kv_heads, head_dim, generator=gen).to(dtype)
    if kind == "int8":
        rows = kv_quant.quantize(torch.stack([k, v]), "int8")
        kd, vd = kv_quant.dequantize(rows, "int8")
        nan16 = torch.tensor([float("nan")], dtype=torch.float16).view(torch.int8)
        for block, off in nan_rows + [(poison, block_size)]:
            rows[:, :, block, :off, head_dim:] = nan16  # NaN scales
        kc, vc = rows[0].contiguous(), rows[1].contiguous()
    else:
        kc, vc = k.to(dtype), v.to(dtype)
        kd, vd = kc, vc
        for block, off in nan_rows + [(poison, block_size)]:
            kc[:, block, :off] = float("nan")
            vc[:, block, :off] = float("nan")
    return q, kc, vc, kd, vd, table, ctx


def _tol(kind):
    return dict(atol=1e-5, rtol=1e-5) if kind == "f32" else dict(atol=2e-2, rtol=2e-2)


WINDOW = 37  # not a multiple of either block size
# shorter than the window, equal, one past, a block past, many blocks past, ends on a block
CONTEXTS = [1, 5, WINDOW - 1, WINDOW, WINDOW + 1, WINDOW + 16, 3 * WINDOW + 7, 128]


@pytest.mark.parametrize("kind", ["bf16", "f32", "int8"])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_window_matches_attention_over_the_window(level_kernels, head_dim, group, block_size,
                                                  kind):
    q, kc, vc, kd, vd, table, ctx = _case(head_dim, group, block_size, CONTEXTS, WINDOW,
                                          kind, seed=head_dim + group + block_size)
    scale = head_dim ** -0.5
    expected = _reference(q, kd, vd, table, ctx, scale, WINDOW)
    for split in (None, 0, 16, 40):  # as the batch suits, none, fixed ranges
        out = torch.full_like(q, float("nan"))
        level_kernels.paged_decode(q, kc, vc, table, ctx, out, scale, split, WINDOW)
        torch.testing.assert_close(out.double(), expected, **_tol(kind),
                                   msg=lambda m: f"split {split}: {m}")


@pytest.mark.parametrize("kind", ["bf16", "f32", "int8"])
def test_window_on_the_generic_loops(level_kernels, kind):
    """Shapes without a fast path (head_dim 80, group 5 at 256, group 12) bound the window
    the same way."""
    for head_dim, group, bs in [(80, 2, 4), (256, 5, 16), (64, 12, 16), (24, 1, 16)]:
        q, kc, vc, kd, vd, table, ctx = _case(head_dim, group, bs, CONTEXTS, WINDOW, kind,
                                              seed=head_dim + group, kv_heads=1)
        scale = head_dim ** -0.5
        out = torch.full_like(q, float("nan"))
        level_kernels.paged_decode(q, kc, vc, table, ctx, out, scale, None, WINDOW)
        torch.testing.assert_close(out.double(),
                                   _reference(q, kd, vd, table, ctx, scale, WINDOW),
                                   **_tol(kind), msg=lambda m: f"{head_dim}/{group}: {m}")


def test_long_windows_split_across_threads(level_kernels):
    """A lone long row (Gemma 3's local layers: window 512, head_dim 256, 4/1 heads) is
    cut into context ranges across threads, counted from the window's first block; the
    same result on one thread or several, and the reference's."""
    for window, contexts in [(512, [3000]), (1000, [2999, 700, 1001])]:
        q, kc, vc, kd, vd, table, ctx = _case(256, 4, 16, contexts, window, "bf16", seed=5,
                                              kv_heads=1)
        expected = _reference(q, kd, vd, table, ctx, 1 / 16, window)
        old = torch.get_num_threads()
        try:
            for threads in (1, 2):
                torch.set_num_threads(threads)
                out = torch.empty_like(q)
                level_kernels.paged_decode(q, kc, vc, table, ctx, out, 1 / 16, None, window)
                torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)
        finally:
            torch.set_num_threads(old)


def test_fixed_split_with_a_window_is_batch_invariant(level_kernels):
    """With fixed ranges, a row's result is bit-identical alone and among other rows
    (which change the work items and their threads)."""
    contexts = [300, 77, 1000, 37, 512, 513]
    q, kc, vc, _, _, table, ctx = _case(256, 2, 16, contexts, 120, "bf16", seed=9)
    together = torch.empty_like(q)
    level_kernels.paged_decode(q, kc, vc, table, ctx, together, 0.0625, 32, 120)
    for r in range(len(contexts)):
        alone = torch.empty_like(q[r:r + 1])
        level_kernels.paged_decode(q[r:r + 1].contiguous(), kc, vc, table[r:r + 1].contiguous(),
                                   ctx[r:r + 1].contiguous(), alone, 0.0625, 32, 120)
        assert torch.equal(alone, together[r:r + 1]), r


def test_no_window_is_the_whole_context(level_kernels):
    """window None, 0 and one at least the context read everything, bit for bit alike."""
    q, kc, vc, _, _, table, ctx = _case(256, 4, 16, [100, 260, 7], 0, "bf16", seed=2)
    outs = []
    for window in (None, 0, 260, 10_000):
        out = torch.empty_like(q)
        level_kernels.paged_decode(q, kc, vc, table, ctx, out, 0.0625, None, window)
        outs.append(out)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_head_dim_256_takes_the_fast_path(level_kernels):
    vector = level_kernels.simd_width > 0
    for group in (1, 2, 3, 4):
        assert level_kernels.supports_fast_decode(256, group) is vector
    assert not level_kernels.supports_fast_decode(256, 5)
    assert not level_kernels.supports_fast_decode(256, 8)


# ---- the cpu-native backend's sliding layers ---------------------------------------------

def test_backend_sliding_layer_decodes_on_the_kernel_over_the_sliding_tables(level_kernels):
    """A sliding layer's decode rows (single-token and short rows) on the windowed kernel
    over the sliding group's tables (stale entries before the window: -1), its prefill row
    on the torch path's windowed spans, K/V written at the sliding group's slots: equal
    to the reference backend over the same cache."""
    from treadle.layers.attention import AttentionLayer, AttentionStep
    from treadle.worker.attention.reference import ReferenceBackend
    from treadle.worker.cpu.native_attention import CpuNativeBackend, NativeDecode

    if not level_kernels.supports(torch.bfloat16):
        pytest.skip("no bf16 decode kernel")
    bs, window, kvh, heads, d = 4, 10, 1, 4, 256
    gen = torch.Generator().manual_seed(1)
    # rows: two decodes, a short row of 3 tokens, a prefill of 12
    computed = np.array([30, 6, 21, 17])
    lens = np.array([1, 1, 3, 12])
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    ctx = computed + lens
    num_blocks = 64
    width = int((ctx.max() + bs - 1) // bs)
    main = np.arange(len(lens) * width).reshape(len(lens), width)  # the full group's
    sliding = np.full((len(lens), width), -1, dtype=np.int64)
    perm = np.random.default_rng(0).permutation(num_blocks)
    at = 0
    for r in range(len(lens)):
        fb = max(0, int(computed[r]) - window + 1) // bs
        n = int((ctx[r] + bs - 1) // bs)
        sliding[r, fb:n] = perm[at:at + n - fb]
        at += n - fb

    def slots_of(table):
        pos = np.concatenate([np.arange(c, c + n) for c, n in zip(computed, lens)])
        rows = np.repeat(np.arange(len(lens)), lens)
        return table[rows, pos // bs] * bs + pos % bs

    step = AttentionStep(lens, starts, computed, main, slots_of(main), 2, bs, num_blocks)
    step.sliding = AttentionStep(lens, starts, computed, sliding, slots_of(sliding), 2, bs,
                                 num_blocks)
    cache = torch.randn(2, kvh, num_blocks, bs, d, generator=gen).to(torch.bfloat16)
    tokens = int(lens.sum())
    qk = torch.randn(tokens, heads + kvh, d, generator=gen).to(torch.bfloat16)
    value = torch.randn(tokens, kvh, d, generator=gen).to(torch.bfloat16)
    layer = AttentionLayer(heads, kvh, d, d ** -0.5, sliding_window=window)

    backend = CpuNativeBackend(level_kernels, None, kvh, d, torch.bfloat16)
    meta = backend.build_metadata(step, torch.device("cpu"))
    native_cache = cache.clone()
    out = backend.forward(layer, qk, value, native_cache, meta, None)
    nd, _ = meta.sliding()
    assert isinstance(nd, NativeDecode) and nd.num_rows == 5  # 2 decodes + 3 short tokens
    assert torch.equal(nd.block_table[0], torch.from_numpy(sliding[0]))
    assert meta.sliding()[0] is nd  # made once per step

    ref = ReferenceBackend()
    ref_cache = cache.clone()
    expected = ref.forward(layer, qk, value, ref_cache,
                           ref.build_metadata(step, torch.device("cpu")), None)
    assert torch.equal(native_cache, ref_cache)  # K/V at the sliding group's slots
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
