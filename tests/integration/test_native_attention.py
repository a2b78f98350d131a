"""The C decode-attention kernel against a plain softmax(QK^T)V over each request's blocks,
once per kernel ISA level this CPU executes (worker/cpu/cpu_isa.py)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def kernels(level_kernels):
    return level_kernels


def reference(q, kc, vc, block_table, ctx_lens, scale):
    num_reqs, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kc.shape[0], kc.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float32)
    for r in range(num_reqs):
        n = int(ctx_lens[r])
        blocks = block_table[r, :(n + block_size - 1) // block_size]
        k = kc[:, blocks].reshape(num_kv_heads, -1, head_dim)[:, :n].float()
        v = vc[:, blocks].reshape(num_kv_heads, -1, head_dim)[:, :n].float()
        qq = q[r].view(num_kv_heads, group, head_dim).float()
        probs = torch.softmax(qq @ k.transpose(1, 2) * scale, dim=-1)
        out[r] = (probs @ v).reshape(num_heads, head_dim)
    return out


# (num_reqs, num_heads, num_kv_heads, head_dim, block_size, max_context, scale). The kernel
# has a fast path specialised for head_dim 64 and 128 with 1..8 query heads per KV head
# (AVX-512 or AVX2 builds), which walks keys in chunks of 16 (8) tokens and splits long
# contexts of small batches across threads; every other shape takes the generic loops.
SHAPES = [
    (5, 9, 3, 64, 16, 300, 0.125),     # the benchmark model's layout (group 3)
    (64, 9, 3, 64, 16, 500, 0.125),    # a large batch
    (1, 9, 3, 64, 16, 4000, 0.125),    # one long context: many blocks, split across threads
    (4, 9, 3, 64, 16, 700, 0.125),     # a few long contexts, split too
    (3, 8, 8, 64, 16, 300, 0.5),       # group 1, peaky softmax
    (4, 8, 2, 128, 16, 400, 0.09),     # group 4, head_dim 128
    (3, 16, 2, 128, 32, 600, 0.3),     # group 8, blocks of two chunks
    (2, 14, 2, 128, 64, 900, 0.09),    # group 7, blocks of four chunks
    (1, 4, 4, 128, 16, 1, 0.09),       # a single one-token context
    (3, 12, 6, 64, 8, 200, 0.125),     # group 2, blocks shorter than a chunk
    (2, 9, 3, 64, 5, 150, 0.125),      # blocks of an odd size
    (3, 4, 2, 24, 4, 300, 0.125),      # generic: odd head_dim
    (3, 9, 3, 80, 16, 300, 0.11),      # generic: head_dim 80, group 3
    (7, 8, 8, 32, 16, 300, 0.125),     # generic: head_dim 32
    (2, 6, 1, 16, 1, 300, 0.125),      # generic: blocks of one token
    (2, 12, 1, 64, 16, 300, 0.125),    # generic: group 12 (beyond the specialised ones)
]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_paged_decode_matches_reference(kernels, dtype, tol, shape):
    num_reqs, num_heads, num_kv_heads, head_dim, block_size, max_ctx, scale = shape
    gen = torch.Generator().manual_seed(sum(shape[:-1]))
    ctx = torch.randint(1, max_ctx + 1, (num_reqs,), generator=gen)
    ctx[0] = 1  # a context of one token (the new one)
    if num_reqs > 1:
        ctx[1] = max_ctx  # the longest, whatever the draw
    if num_reqs > 2:
        ctx[2] = max(1, max_ctx // block_size) * block_size  # ends on a block boundary
    max_blocks = int((ctx.max() + block_size - 1) // block_size)
    num_blocks = max(400, max_blocks + 7)
    kc = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=gen).to(dtype)
    vc = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=gen).to(dtype)
    q = torch.randn(num_reqs, num_heads, head_dim, generator=gen).to(dtype)
    table = torch.stack([torch.randperm(num_blocks, generator=gen)[:max_blocks]
                         for _ in range(num_reqs)])
    if num_reqs > 1:  # a request whose blocks follow one another in memory
        start = int(torch.randint(0, num_blocks - max_blocks + 1, (1,), generator=gen))
        table[-1] = torch.arange(start, start + max_blocks)
    out = torch.full_like(q, float("nan"))
    kernels.paged_decode(q, kc, vc, table, ctx, out, scale)
    expected = reference(q, kc, vc, table, ctx, scale)
    assert torch.allclose(out.float(), expected, atol=tol, rtol=tol)


def test_paged_decode_ignores_cache_rows_past_the_context(kernels):
    """The rows of a request's last block beyond its context are never attended, whatever
    they hold (here NaN: an uninitialised cache may hold anything)."""
    gen = torch.Generator().manual_seed(7)
    for head_dim, block_size in [(64, 16), (128, 32), (80, 16)]:
        kc = torch.randn(3, 40, block_size, head_dim, generator=gen).to(torch.bfloat16)
        vc = torch.randn(3, 40, block_size, head_dim, generator=gen).to(torch.bfloat16)
        q = torch.randn(2, 9, head_dim, generator=gen).to(torch.bfloat16)
        ctx = torch.tensor([block_size * 3 + 5, 1])
        table = torch.tensor([[4, 9, 2, 30], [11, 0, 0, 0]])
        expected = reference(q, kc, vc, table, ctx, 0.125)
        kc[:, 30, 5:] = float("nan")
        vc[:, 30, 5:] = float("nan")
        kc[:, 11, 1:] = float("nan")
        vc[:, 11, 1:] = float("nan")
        out = torch.empty_like(q)
        kernels.paged_decode(q, kc, vc, table, ctx, out, 0.125)
        assert torch.allclose(out.float(), expected, atol=1e-2, rtol=1e-2), head_dim


def test_paged_decode_same_result_on_one_thread_or_several(kernels):
    """Splitting a long context across threads (partial softmaxes, merged) changes only
    rounding."""
    gen = torch.Generator().manual_seed(3)
    kc = torch.randn(3, 600, 16, 64, generator=gen).to(torch.bfloat16)
    vc = torch.randn(3, 600, 16, 64, generator=gen).to(torch.bfloat16)
    q = torch.randn(2, 9, 64, generator=gen).to(torch.bfloat16)
    ctx = torch.tensor([4000, 3001])
    table = torch.stack([torch.randperm(600, generator=gen)[:250] for _ in range(2)])
    old = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 4):
            torch.set_num_threads(threads)
            out = torch.empty_like(q)
            kernels.paged_decode(q, kc, vc, table, ctx, out, 0.125)
            outs.append(out.float())
    finally:
        torch.set_num_threads(old)
    for out in outs[1:]:
        assert torch.allclose(out, outs[0], atol=1e-2, rtol=1e-2)


def test_unsupported_shape_is_an_error(kernels):
    q = torch.zeros(1, 128, 64)
    kc = torch.zeros(1, 2, 16, 64)
    with pytest.raises(ValueError, match="exceeds its limits"):
        kernels.paged_decode(q, kc, kc, torch.zeros(1, 1, dtype=torch.long),
                             torch.ones(1, dtype=torch.long), torch.empty_like(q), 1.0)


def test_loading_the_kernels_keeps_subnormal_floats(kernels):
    """A shared object linked with -ffast-math switches the whole process to flush-to-zero
    on load; the kernels must leave every other computation's floats alone."""
    import numpy as np

    assert 5e-324 * 1.0 != 0.0
    assert (np.array([1e-310]) * 0.5)[0] != 0.0
    assert (torch.tensor([1e-40], dtype=torch.float32) * 0.5).item() != 0.0
