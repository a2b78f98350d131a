"""Megatron-style tensor-parallel layers and the shard geometry of one rank.

Owns how a model's dimensions divide over the ranks of one pipeline stage: query heads
and MLP columns split evenly, KV heads split (or, with fewer KV heads than ranks, each
replicated on tp / num_kv_heads ranks), the vocabulary split in contiguous ranges (padded
to a multiple of the ranks). Column-parallel layers are plain `Linear`s of the shard's
width (their input is replicated, their output split); `RowParallelLinear` takes a split
input and all-reduces its partial sums, its bias added once after the sum;
`VocabParallelEmbedding` looks up only its vocabulary range and all-reduces. With one
rank every layer is the plain layer and no collective runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from treadle.layers.linear import Linear
from treadle.layers.parallel import ParallelContext


@dataclass(frozen=True)
class ShardGeometry:
    """One rank's share of the model's heads, MLP columns and vocabulary."""

    tp_size: int
    tp_rank: int
    num_heads: int
    """Query heads of this rank."""
    num_kv_heads: int
    """KV heads of this rank."""
    head_dim: int
    intermediate_size: int
    """MLP columns of this rank."""
    vocab_size: int
    """The whole vocabulary."""

    @classmethod
    def of(cls, ctx: ParallelContext, num_heads: int, num_kv_heads: int, head_dim: int,
           intermediate_size: int, vocab_size: int) -> "ShardGeometry":
        tp = ctx.tp_size
        if num_heads % tp or intermediate_size % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide the model's "
                             f"{num_heads} attention heads and intermediate size "
                             f"{intermediate_size}")
        if num_kv_heads % tp and tp % num_kv_heads:
            raise ValueError(f"tensor_parallel_size={tp} and the model's {num_kv_heads} KV "
                             "heads must divide one another")
        return cls(tp, ctx.tp_rank, num_heads // tp, max(num_kv_heads // tp, 1), head_dim,
                   intermediate_size // tp, vocab_size)

    def q_heads(self) -> tuple[int, int]:
        """[first, last) query head of this rank in the whole model."""
        return self.tp_rank * self.num_heads, (self.tp_rank + 1) * self.num_heads

    def kv_heads(self, total_kv_heads: int) -> tuple[int, int]:
        """[first, last) KV head of this rank (a replicated head when there are fewer KV
        heads than ranks)."""
        if total_kv_heads >= self.tp_size:
            return self.tp_rank * self.num_kv_heads, (self.tp_rank + 1) * self.num_kv_heads
        head = self.tp_rank // (self.tp_size // total_kv_heads)
        return head, head + 1

    def columns(self) -> tuple[int, int]:
        """[first, last) MLP column of this rank."""
        return self.tp_rank * self.intermediate_size, (self.tp_rank + 1) * self.intermediate_size

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.vocab_size // self.tp_size)

    def vocab_range(self) -> tuple[int, int]:
        """[first, last) token id of this rank's vocabulary shard (last may pass the real
        vocabulary: those rows are padding)."""
        n = self.vocab_per_rank
        return self.tp_rank * n, (self.tp_rank + 1) * n


class RowParallelLinear(Linear):
    """y = all_reduce(x_shard @ weight_shard.T) + bias: input features split over ranks,
    the bias (whole on every rank) added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 parallel: ParallelContext) -> None:
        super().__init__(in_features, out_features, bias, dtype)
        self.parallel = parallel

    @property
    def kernel_bias(self) -> torch.Tensor | None:
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernel(x) if self.kernel is not None else F.linear(x, self.weight)
        y = self.parallel.all_reduce(y)
        return y if self.bias is None else y.add_(self.bias)


class VocabParallelEmbedding(nn.Module):
    """Embedding lookup of a vocabulary range; ids outside it contribute zeros."""

    def __init__(self, shard: ShardGeometry, hidden_size: int, dtype: torch.dtype,
                 parallel: ParallelContext) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shard.vocab_per_rank, hidden_size, dtype=dtype))
        self.first, self.last = shard.vocab_range()
        self.parallel = parallel

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.first) | (input_ids >= self.last)
        local = (input_ids - self.first).masked_fill_(outside, 0)
        out = F.embedding(local, self.weight)
        out.masked_fill_(outside.unsqueeze(1), 0)
        return self.parallel.all_reduce(out)
