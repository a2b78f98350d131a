"""P/D's worker side (treadle/worker/kv_transfer.py) on plain CPU tensors, no model: blocks
exported by every rank of one TP x PP split and landed by every rank of another — either
KV layout on each side, replicated KV heads, bfloat16 — leave each receiving rank exactly
its layers and heads of those blocks; a payload of another KV dtype, block size or model
is refused with the reason, writing nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from treadle.worker.kv_transfer import KVShare, export_blocks, import_blocks

NUM_LAYERS, NUM_HEADS, NUM_BLOCKS, BLOCK_SIZE, ROW = 4, 2, 6, 2, 3


def whole_kv(dtype=torch.float32) -> torch.Tensor:
    """Every layer's KV of the whole model: [layers, 2, blocks, block_size, heads, row]."""
    torch.manual_seed(0)
    return torch.randn(NUM_LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, ROW).to(dtype)


def shares(tp: int, pp: int) -> list[KVShare]:
    """Each rank's layers and KV heads, in rank order (tp fastest), as the models split
    them (a replicated head when there are fewer KV heads than ranks)."""
    per_stage, out = NUM_LAYERS // pp, []
    for stage in range(pp):
        for tp_rank in range(tp):
            if NUM_HEADS >= tp:
                n = NUM_HEADS // tp
                heads = (tp_rank * n, (tp_rank + 1) * n)
            else:
                head = tp_rank // (tp // NUM_HEADS)
                heads = (head, head + 1)
            out.append(KVShare((stage * per_stage, (stage + 1) * per_stage), heads))
    return out


def rank_caches(kv: torch.Tensor, share: KVShare, layout: str) -> list[torch.Tensor]:
    """One rank's per-layer caches holding its share of `kv`, in `layout`."""
    part = kv[share.layers[0]:share.layers[1], ..., share.heads[0]:share.heads[1], :]
    if layout == "heads_first":  # [2, heads, blocks, block_size, row]
        return [layer.permute(0, 3, 1, 2, 4).contiguous() for layer in part]
    return [layer.contiguous() for layer in part]


def as_transfer(caches: list[torch.Tensor], layout: str) -> torch.Tensor:
    if layout == "heads_first":
        return torch.stack([c.permute(0, 2, 3, 1, 4) for c in caches])
    return torch.stack(caches)


SPLITS = [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)]


@pytest.mark.parametrize("sender", SPLITS)
@pytest.mark.parametrize("receiver", SPLITS)
@pytest.mark.parametrize("layouts", [("heads_first", "blocks_first"),
                                     ("blocks_first", "heads_first")])
def test_blocks_move_between_any_two_splits(sender, receiver, layouts):
    kv = whole_kv()
    send_layout, receive_layout = layouts
    parts = [export_blocks(rank_caches(kv, s, send_layout), send_layout, "auto", [1, 4], s)
             for s in shares(*sender)]
    for share in shares(*receiver):
        caches = rank_caches(torch.zeros_like(kv), share, receive_layout)
        assert import_blocks(caches, receive_layout, "auto", [0, 5], parts, share) is None
        got = as_transfer(caches, receive_layout)
        want = kv[share.layers[0]:share.layers[1], ..., share.heads[0]:share.heads[1], :]
        assert torch.equal(got[:, :, [0, 5]], want[:, :, [1, 4]])
        assert not got[:, :, 1:5].any()  # no other block written


def test_bfloat16_travels_as_int16_and_lands_exactly():
    kv = whole_kv(torch.bfloat16)
    share = shares(1, 1)[0]
    part = export_blocks(rank_caches(kv, share, "heads_first"), "heads_first", "auto", [2, 3],
                         share)
    assert (part.dtype, part.data.dtype, part.num_blocks) == ("bfloat16", np.int16, 2)
    caches = rank_caches(torch.zeros_like(kv), share, "heads_first")
    assert import_blocks(caches, "heads_first", "auto", [2, 3], [part], share) is None
    got = as_transfer(caches, "heads_first")
    assert torch.equal(got[:, :, [2, 3]], kv[:, :, [2, 3]])
    assert not got[:, :, [0, 1, 4, 5]].any()
    assert part.select(slice(1, None)).num_blocks == 1


@pytest.mark.parametrize("change, words", [
    (dict(kv_cache_dtype="int8"), "kv_cache_dtype int8"),
    (dict(block_size=BLOCK_SIZE + 1), "block_size"),
    (dict(layers=NUM_LAYERS // 2), "does not cover layers"),
])
def test_a_payload_that_does_not_fit_is_refused_and_nothing_is_written(change, words):
    share = shares(1, 1)[0]
    sent = torch.ones(NUM_LAYERS, 2, NUM_BLOCKS, change.get("block_size", BLOCK_SIZE),
                      NUM_HEADS, ROW)
    layers = change.get("layers", NUM_LAYERS)
    sender = KVShare((0, layers), share.heads)
    part = export_blocks(list(sent[:layers]), "blocks_first",
                         change.get("kv_cache_dtype", "auto"), [0], sender)
    caches = rank_caches(torch.zeros_like(whole_kv()), share, "blocks_first")
    reason = import_blocks(caches, "blocks_first", "auto", [3], [part], share)
    assert reason is not None and words in reason
    assert not any(c.any() for c in caches)
