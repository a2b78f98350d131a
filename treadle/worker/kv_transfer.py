"""P/D's worker side: one rank's share of some KV blocks out of its KV tensors, and into
them.

Owns the tensor work of moving a prompt's KV between engines (the engine side,
treadle/distributed/kv_transfer.py, owns the payload, the prefix hashes and the prefix
cache, and reaches this module only through `Worker.export_kv_blocks` /
`import_kv_blocks` and the executor's `collective_rpc`):
- `export_blocks`: the given blocks of every local layer as one `KVPart`, this rank's
  share of the model's KV: its layers (pipeline stage) and its KV heads (tensor-parallel
  shard), in the transfer layout below whatever the cache's layout.
- `import_blocks`: this rank's layers and heads, assembled from the parts of a payload
  (one per rank of the sending engine, whatever its TP x PP split was), written into
  the given blocks.

Transfer layout of a part's `data`: [layers, 2 (K, V), blocks, block_size, heads, row]
(a cache layout's axes in one fixed order: `blocks_first` per layer, stacked), with
bfloat16 viewed as int16 (numpy has no bfloat16). It must not decide which blocks move,
know hashes or the scheduler. It imports torch inside its functions only, so the engine
side holds and slices KVParts without torch.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

_TO_TRANSFER = {"heads_first": (0, 2, 3, 1, 4), "blocks_first": (0, 1, 2, 3, 4)}
"""Cache layout -> the permutation of one layer's selected blocks into the transfer
order [2, blocks, block_size, heads, row] (worker/kv_cache.py names the layouts)."""
_FROM_TRANSFER = {"heads_first": (0, 3, 1, 2, 4), "blocks_first": (0, 1, 2, 3, 4)}
"""Its inverse: transfer order -> the cache layout's."""
BLOCK_AXIS = 2
"""The axis of a part's data that indexes blocks."""


@dataclass(frozen=True)
class KVShare:
    """Which slice of the whole model's KV a rank holds."""

    layers: tuple[int, int]
    """[first, last) layer of the whole model (the rank's pipeline stage)."""
    heads: tuple[int, int]
    """[first, last) KV head of the whole model (the rank's tensor-parallel shard; a
    replicated head when there are fewer KV heads than ranks)."""


@dataclass(frozen=True)
class KVPart:
    """One rank's share of some blocks' KV, in the transfer layout."""

    share: KVShare
    kv_cache_dtype: str
    """auto (the model's dtype), int8 or fp8_e4m3 (worker/kv_quant.py)."""
    dtype: str
    """The cache tensors' element type ('bfloat16' is stored as int16)."""
    data: np.ndarray
    """[layers, 2, blocks, block_size, heads, row]."""

    @property
    def num_blocks(self) -> int:
        return self.data.shape[BLOCK_AXIS]

    def select(self, rows) -> "KVPart":
        """The part with only the blocks `rows` (a slice or indices, in carried order)."""
        index = [slice(None)] * self.data.ndim
        index[BLOCK_AXIS] = rows
        return KVPart(self.share, self.kv_cache_dtype, self.dtype,
                      np.ascontiguousarray(self.data[tuple(index)]))


def _block_dim(layout: str) -> int:
    """The cache axis that indexes blocks: where the transfer order's block axis goes."""
    return _FROM_TRANSFER[layout].index(1)


def rank_share(model) -> KVShare:
    """This rank's slice of the model's KV: its stage's layers, its shard's KV heads."""
    return KVShare(tuple(model.layer_range), model.shard.kv_heads(model.total_num_kv_heads))


def export_blocks(caches: list, layout: str, kv_cache_dtype: str, block_ids: list[int],
                  share: KVShare) -> KVPart:
    """The blocks `block_ids` of every local layer's cache, as this rank's part."""
    import torch

    ids = torch.tensor(block_ids, dtype=torch.long)
    block_dim = _block_dim(layout)
    data = torch.stack([c.index_select(block_dim, ids.to(c.device))
                        .permute(_TO_TRANSFER[layout]).cpu() for c in caches])
    dtype = str(data.dtype).removeprefix("torch.")
    if data.dtype == torch.bfloat16:
        data = data.view(torch.int16)
    return KVPart(share, kv_cache_dtype, dtype, data.numpy())


def assemble(parts: list[KVPart], share: KVShare) -> np.ndarray:
    """The data of `share` (layers x heads) out of parts that together cover it: one part
    as it is when it is exactly this share, else the overlapping slices copied together
    (parts of another TP x PP split)."""
    for part in parts:
        if part.share == share:
            return part.data
    (l0, l1), (h0, h1) = share.layers, share.heads
    first = parts[0].data
    out = np.empty((l1 - l0, *first.shape[1:4], h1 - h0, first.shape[5]), first.dtype)
    covered = np.zeros((l1 - l0, h1 - h0), dtype=bool)
    for part in parts:
        (pl0, pl1), (ph0, ph1) = part.share.layers, part.share.heads
        a, b = max(l0, pl0), min(l1, pl1)
        c, d = max(h0, ph0), min(h1, ph1)
        if a >= b or c >= d:
            continue
        out[a - l0:b - l0, ..., c - h0:d - h0, :] = \
            part.data[a - pl0:b - pl0, ..., c - ph0:d - ph0, :]
        covered[a - l0:b - l0, c - h0:d - h0] = True
    if not covered.all():
        raise ValueError(f"the KV payload does not cover layers {share.layers} x KV heads "
                         f"{share.heads} (its parts: {[p.share for p in parts]}): the prefill "
                         "and decode engines must serve the same model")
    return out


def check_parts(parts: list[KVPart], caches: list, layout: str, kv_cache_dtype: str,
                num_blocks: int) -> str | None:
    """Why these parts cannot land in these caches, or None."""
    kinds = {(p.kv_cache_dtype, p.dtype) for p in parts}
    if len(kinds) > 1:
        return f"the KV payload's parts disagree on their dtype: {sorted(kinds)}"
    their_kind = next(iter(kinds))[0]
    if their_kind != kv_cache_dtype:
        return (f"the KV payload is kv_cache_dtype {their_kind} (the prefill engine's), "
                f"this engine's is {kv_cache_dtype}: kv_cache_dtype must match on both sides")
    one = caches[0].permute(_TO_TRANSFER[layout]).shape  # [2, N, B, heads, row]
    shape = parts[0].data.shape
    if (shape[3], shape[5]) != (one[2], one[4]):
        return (f"the KV payload has blocks of {shape[3]} tokens and rows of {shape[5]} "
                f"elements, this engine {one[2]} and {one[4]}: block_size and the model "
                "must match on both sides")
    if any(p.num_blocks != num_blocks for p in parts):
        return f"the KV payload's parts do not all carry {num_blocks} blocks"
    return None


def import_blocks(caches: list, layout: str, kv_cache_dtype: str, block_ids: list[int],
                  parts: list[KVPart], share: KVShare) -> str | None:
    """Write this rank's share of the parts' blocks into blocks `block_ids`; None when
    done, else why nothing was written (the engine side fails that one landing)."""
    import torch

    reason = check_parts(parts, caches, layout, kv_cache_dtype, len(block_ids))
    if reason is not None:
        return reason
    try:
        data = assemble(parts, share)
    except ValueError as exc:
        return str(exc)
    with warnings.catch_warnings():  # Ray's object store arrays are read-only: only read
        warnings.simplefilter("ignore", UserWarning)
        data = torch.from_numpy(data)
    if parts[0].dtype == "bfloat16":
        data = data.view(torch.bfloat16)
    ids = torch.tensor(block_ids, dtype=torch.long)
    block_dim = _block_dim(layout)
    for layer, cache in enumerate(caches):
        src = data[layer].permute(_FROM_TRANSFER[layout]).to(cache.device, cache.dtype)
        cache.index_copy_(block_dim, ids.to(cache.device), src)
    return None
