"""The C decode-attention kernel against a plain softmax(QK^T)V over each request's blocks."""

from __future__ import annotations

import pytest
import torch

from treadle.worker.native import load_kernels


@pytest.fixture(scope="module")
def kernels():
    k = load_kernels()
    assert k is not None, "the C kernels must build on the test machine (gcc is required)"
    return k


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


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("shape", [(5, 9, 3, 64, 16), (3, 4, 2, 24, 4), (7, 8, 8, 32, 16),
                                   (2, 6, 1, 16, 1)])
def test_paged_decode_matches_reference(kernels, dtype, tol, shape):
    num_reqs, num_heads, num_kv_heads, head_dim, block_size = shape
    gen = torch.Generator().manual_seed(sum(shape))
    num_blocks = 400
    kc = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=gen).to(dtype)
    vc = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=gen).to(dtype)
    q = torch.randn(num_reqs, num_heads, head_dim, generator=gen).to(dtype)
    ctx = torch.randint(1, 300, (num_reqs,), generator=gen)
    ctx[0] = 1  # a context of one token (the new one)
    max_blocks = int((ctx.max() + block_size - 1) // block_size)
    table = torch.stack([torch.randperm(num_blocks, generator=gen)[:max_blocks]
                         for _ in range(num_reqs)])
    out = torch.full_like(q, float("nan"))
    kernels.paged_decode(q, kc, vc, table, ctx, out, 0.125)
    expected = reference(q, kc, vc, table, ctx, 0.125)
    assert torch.allclose(out.float(), expected, atol=tol, rtol=tol)


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
