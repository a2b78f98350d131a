"""The torch backend's prefill spans (worker/attention/torch_backend.py) against a plain
float32 causal softmax(QK^T)V: a first chunk (torch's causal flag), a chunk after a cached
prefix (a float mask), a sliding window narrower than the chunk (a mask again), and a
short chunk on the grouped matmuls."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from treadle.layers.attention import AttentionStep
from treadle.worker.attention.torch_backend import attend_prefill_spans, prefill_span

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 32, 8


def _reference(q, k, v, start, window):
    n, ctx = q.shape[0], start + q.shape[0]
    k, v = k[:, :ctx].float(), v[:, :ctx].float()  # [kv_heads, ctx, dim]
    group = HEADS // KV_HEADS
    scores = torch.einsum("nhd,hcd->hnc", q.float(), k.repeat_interleave(group, 0))
    pos = torch.arange(ctx)[None, :]
    query = (start + torch.arange(n))[:, None]
    allowed = pos <= query
    if window is not None:
        allowed &= pos > query - window
    probs = torch.softmax((scores / math.sqrt(HEAD_DIM)).masked_fill(~allowed, -math.inf), -1)
    return torch.einsum("hnc,hcd->nhd", probs, v.repeat_interleave(group, 0)).reshape(n, -1)


@pytest.mark.parametrize("start, n, window, plain", [
    (0, 96, None, True),     # a first chunk: is_causal
    (40, 96, None, False),   # after a cached prefix: the float mask
    (0, 96, 33, False),      # a window cutting into the chunk: the float mask
    (0, 96, 200, True),      # a window wider than the chunk: plain causal again
    (16, 12, None, False),   # few scores: the grouped matmuls
])
def test_prefill_span_attention_matches_reference(start, n, window, plain):
    gen = torch.Generator().manual_seed(start + n)
    ctx = start + n
    num_blocks = (ctx + BLOCK - 1) // BLOCK
    cache = torch.zeros(2, KV_HEADS, num_blocks + 2, BLOCK, HEAD_DIM)
    order = torch.randperm(num_blocks + 2, generator=gen)[:num_blocks]
    keys = torch.randn(2, KV_HEADS, num_blocks * BLOCK, HEAD_DIM, generator=gen)
    cache[:, :, order] = keys.view(2, KV_HEADS, num_blocks, BLOCK, HEAD_DIM)
    q = torch.randn(n, HEADS, HEAD_DIM, generator=gen)
    step = AttentionStep(query_lens=np.array([n]), query_starts=np.array([0]),
                         num_computed=np.array([start]),
                         block_table=order.numpy().reshape(1, -1).astype(np.int64),
                         slot_mapping=np.zeros(n, dtype=np.int64), num_single_token_rows=0,
                         block_size=BLOCK, num_cache_blocks=num_blocks + 2)
    span = prefill_span(step, 0, KV_HEADS, torch.device("cpu"), window)
    assert span.plain_causal == plain
    out = torch.zeros(n, HEADS * HEAD_DIM)
    attend_prefill_spans(q, cache, [span], out, HEAD_DIM ** -0.5)
    expected = _reference(q, keys[0], keys[1], start, window)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
