"""The KV-cache tensors: their layout and dtype, how many blocks fit in the memory given,
the per-layer tensors, the swap space, and block copies between them.

Owns the physical storage only, the worker side of the engine core's KV specs
(kv_specs/specs.py: what a group is and what a slot stores; core/kv/config.py: how many
blocks each layer's tensor gets, decided once by the engine core). Which request uses
which block is decided in core/, and how attention reads a layout is its backend's
business (worker/attention). A layout is named by the backend that uses it:

- `heads_first`: per layer [2 (K, V), num_kv_heads, num_blocks, block_size, head_dim].
  The head dimension outermost makes a gather of a request's blocks yield [kv_heads,
  tokens, head_dim] directly, the operand layout of a batched matmul (worker/attention/
  torch_backend.py), and is what the C kernels read.
- `blocks_first`: per layer [2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]:
  a block contiguous across heads (one run per swap copy), one row per token for the
  K/V write, FlashAttention's paged layout; the Triton kernels read it (docs/gpu.md).

On the CPU the tensors come from transparent huge pages (`allocate_kv_caches`), zero
without being written, so that memory becomes resident only as blocks are used. The swap
space (`SwapSpace`) is made on its first use, the first swap-out: a server that never
swaps never reserves it.

With a quantized cache (`kv_cache_dtype` int8 or fp8_e4m3, worker/kv_quant.py) the last
dimension is a row of `head_dim` values and their float16 scale (`head_dim + 2` bytes),
so every block carries its own scales through copies, swaps and prefix-cache reuse.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from treadle.kv_specs.specs import CACHE_DTYPES
from treadle.worker import kv_quant
from treadle.worker.cpu.huge_pages import HugePageArena

logger = logging.getLogger(__name__)

KV_LAYOUTS = {"heads_first": 2, "blocks_first": 1}
"""Layout name -> the dimension that indexes blocks."""


@dataclass(frozen=True)
class KVCacheSpec:
    """One layer's KV tensor layout and dtype, and the number of layers: the tensors of a
    core KV spec's group (its `cache_dtype`, one of kv_specs/specs.py `CACHE_DTYPES`)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    """The model's dtype (what `auto` stores)."""
    layout: str = "heads_first"
    kv_cache_dtype: str = "auto"
    """auto (the model's dtype), int8 or fp8_e4m3 (rows with scales: worker/kv_quant.py)."""

    def __post_init__(self) -> None:
        if self.layout not in KV_LAYOUTS:
            raise ValueError(f"unknown KV layout {self.layout!r}; known: {sorted(KV_LAYOUTS)}")
        kv_quant.check_kv_cache_dtype(self.kv_cache_dtype)

    @property
    def quantized(self) -> bool:
        return kv_quant.is_quantized(self.kv_cache_dtype)

    @property
    def storage_dtype(self) -> torch.dtype:
        """The cache tensors' element type."""
        return kv_quant.STORAGE_DTYPES[self.kv_cache_dtype] if self.quantized else self.dtype

    @property
    def row_elements(self) -> int:
        """Elements of the last dimension: head_dim, or a quantized row's bytes."""
        return kv_quant.row_bytes(self.head_dim) if self.quantized else self.head_dim

    @property
    def block_dim(self) -> int:
        return KV_LAYOUTS[self.layout]

    @property
    def bytes_per_token(self) -> int:
        """2 (K and V) x layers x KV heads x row bytes (head dim x dtype bytes, or a
        quantized row: head dim + its scale, as the cache dtype declares it)."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        row = CACHE_DTYPES[self.kv_cache_dtype].row_bytes(self.head_dim, itemsize)
        return 2 * self.num_layers * self.num_kv_heads * row

    def num_blocks_for_memory(self, num_bytes: int, block_size: int) -> int:
        return num_bytes // (self.bytes_per_token * block_size)

    def shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """One layer's tensor shape."""
        if self.layout == "blocks_first":
            return (2, num_blocks, block_size, self.num_kv_heads, self.row_elements)
        return (2, self.num_kv_heads, num_blocks, block_size, self.row_elements)


def allocate_kv_caches(spec: KVCacheSpec, num_blocks: int, block_size: int,
                       device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """One zeroed tensor per layer.

    Zeroed, not empty: padded attention positions are masked to probability 0, and
    0 x NaN from uninitialised memory would still poison the output. On the CPU the
    tensors are cut from transparent huge pages (worker/cpu/huge_pages.py): a decode step
    streams every running request's K/V, and in 4 KiB pages the hardware prefetcher
    stops at each page's end (docs/benchmarks.md, round 22). Fresh anonymous memory reads
    as zeros, so nothing is written here: writing 2 GiB of zeros took 8 s of a start and
    made all of it resident at once (issue 47).
    """
    shape = spec.shape(num_blocks, block_size)
    if torch.device(device).type == "cpu":
        arena = HugePageArena()
        return [arena.zeros(math.prod(shape), spec.storage_dtype).view(shape)
                for _ in range(spec.num_layers)]
    return [torch.zeros(shape, dtype=spec.storage_dtype, device=device)
            for _ in range(spec.num_layers)]


class SwapSpace(Sequence):
    """Host-memory blocks for swapped-out KV, one tensor per layer laid out like the cache
    (pinned for a GPU), made when a layer's tensor is first asked for: the first
    swap-out. Unpinned, they come from untouched anonymous memory (zeros), so only the
    blocks written take memory. A sequence of tensors, as `copy_blocks` takes."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, block_size: int,
                 pin_memory: bool = False) -> None:
        self.spec, self.num_blocks, self.block_size = spec, num_blocks, block_size
        self.pin_memory = pin_memory
        self._layers: list[torch.Tensor] | None = None

    @property
    def allocated(self) -> bool:
        return self._layers is not None

    @property
    def nbytes(self) -> int:
        """Bytes it reserves once allocated."""
        itemsize = torch.empty((), dtype=self.spec.storage_dtype).element_size()
        return (self.spec.num_layers * math.prod(self.spec.shape(self.num_blocks,
                                                                 self.block_size)) * itemsize)

    def _tensors(self) -> list[torch.Tensor]:
        if self._layers is None:
            shape, dtype = self.spec.shape(self.num_blocks, self.block_size), self.spec.storage_dtype
            if self.pin_memory:
                self._layers = [torch.zeros(shape, dtype=dtype, pin_memory=True)
                                for _ in range(self.spec.num_layers)]
            else:
                arena = HugePageArena()
                self._layers = [arena.zeros(math.prod(shape), dtype).view(shape)
                                for _ in range(self.spec.num_layers)]
            logger.info("swap space reserved on first use: %d blocks, %.2f GiB%s",
                        self.num_blocks, self.nbytes / 2**30, " pinned" if self.pin_memory
                        else " (resident as blocks are written)")
        return self._layers

    def __len__(self) -> int:
        return self.spec.num_layers

    def __getitem__(self, index):
        return self._tensors()[index]


def allocate_swap_space(spec: KVCacheSpec, num_blocks: int, block_size: int,
                        pin_memory: bool = False) -> SwapSpace:
    """Host-memory blocks for swapped-out KV, laid out like the cache (pinned for a GPU),
    reserved on first use (`SwapSpace`)."""
    return SwapSpace(spec, num_blocks, block_size, pin_memory)


def copy_blocks(src: list[torch.Tensor], dst: list[torch.Tensor],
                pairs: list[tuple[int, int]], block_dim: int = 2) -> int:
    """Copy block pairs[i][0] of every layer of `src` to block pairs[i][1] of `dst`.

    Returns the bytes copied.
    """
    if not pairs:
        return 0
    if src[0].device != dst[0].device:
        return _copy_blocks_across(src, dst, pairs, block_dim)
    src_ids = torch.tensor([p[0] for p in pairs], dtype=torch.long)
    dst_ids = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=dst[0].device)
    num_bytes = 0
    for s, d in zip(src, dst):
        blocks = s.index_select(block_dim, src_ids.to(s.device))
        d.index_copy_(block_dim, dst_ids, blocks.to(d.device, non_blocking=True))
        num_bytes += blocks.numel() * blocks.element_size()
    return num_bytes


def _copy_blocks_across(src: list[torch.Tensor], dst: list[torch.Tensor],
                        pairs: list[tuple[int, int]], block_dim: int) -> int:
    """Between the device and (pinned) host memory: one copy per block straight into its
    destination, so that with pinned memory every copy is asynchronous and nothing on the
    host reads a block before it arrives (a gather, then a host-side index_copy_ of a
    non-blocking device-to-host result, would)."""
    num_bytes = 0
    for s, d in zip(src, dst):
        for src_id, dst_id in pairs:
            block = s.select(block_dim, src_id)
            d.select(block_dim, dst_id).copy_(block, non_blocking=True)
            num_bytes += block.numel() * block.element_size()
    return num_bytes
