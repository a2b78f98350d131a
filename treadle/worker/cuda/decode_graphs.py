"""Decode steps replayed from CUDA graphs.

Owns which steps a graph serves (every row has one new token; the runner asks
`accepts`), the static inputs of such a step (token ids, positions, cache slots, context
lengths, block-table rows, in the runner's row order), the forward pass captured at each
size of `cuda_graph_sizes` (worker/cuda/cuda_graphs.py: padded replay), and the decode
kernel's split-K factor per size. A graph fixes its launch grid, so each size is
captured with the splits that `choose_num_splits` gives for a context of max_model_len,
the longest any row can have; a shorter context leaves trailing splits empty (they add
nothing in the merge). Padding rows hold context length 0 (the decode kernel writes
zeros) and slot -1 (the K/V write skips them), so they touch no cache block.

The graph covers the model's forward pass up to the final norm; logits of the rows that
sample are computed after it, eagerly, as in every other step. Prefill and mixed steps,
and any step above the largest size, run eagerly. Only the triton attention backend on a
single rank is captured (its metadata is four tensors; tensor-parallel all-reduce inside a
graph is not done here). On the CPU the same code runs with `ReplayByCall` in place of the
capture (tests: the buffers, the padding and the row order are checked without a GPU).
"""

from __future__ import annotations

import numpy as np
import torch

from treadle.layers.attention import AttentionStep
from treadle.worker.cuda.triton_attention import TritonBackend, TritonMetadata
from treadle.worker.cuda.cuda_graphs import Capture, CudaGraphRunner, StaticInput


class DecodeGraphs:
    """The captured decode forward passes of one model over its KV cache."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor],
                 backend: TritonBackend, sizes: list[int] | tuple[int, ...],
                 max_model_len: int, block_size: int, device: torch.device,
                 capture: Capture | None = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.max_blocks = -(-max_model_len // block_size)
        self.max_model_len = max_model_len
        inputs = [StaticInput("input_ids", (), torch.int64, 0),
                  StaticInput("positions", (), torch.int64, 0),
                  StaticInput("slot_mapping", (), torch.int64, -1),
                  StaticInput("seq_lens", (), torch.int32, 0),
                  StaticInput("block_tables", (self.max_blocks,), torch.int32, 0)]
        self.graphs = CudaGraphRunner(self._forward, inputs, list(sizes), device, capture)
        self.query_start_loc = torch.arange(self.graphs.max_size + 1, dtype=torch.int32,
                                            device=device)
        self.num_splits = {
            size: backend.kernels.choose_num_splits(size, backend.num_kv_heads, max_model_len,
                                                    backend.num_multiprocessors)
            for size in self.graphs.sizes}
        self.num_replays = 0

    def _forward(self, views: dict[str, torch.Tensor]) -> torch.Tensor:
        size = views["input_ids"].shape[0]
        meta = TritonMetadata(self.backend, views["slot_mapping"],
                              self.query_start_loc[:size + 1], views["seq_lens"],
                              views["block_tables"], num_decodes=size,
                              num_splits=self.num_splits[size])
        return self.model(views["input_ids"], views["positions"], self.kv_caches, meta)

    def capture(self) -> None:
        """Capture every size (at start-up, after the KV cache exists)."""
        with torch.inference_mode():
            self.graphs.capture_all()

    def accepts(self, step: AttentionStep) -> bool:
        """Whether this step replays a graph: decodes only, at most the largest size."""
        rows = len(step.query_lens)
        return step.num_single_token_rows == rows and rows <= self.graphs.max_size

    def run(self, input_ids: np.ndarray, positions: np.ndarray,
            step: AttentionStep) -> torch.Tensor:
        """Hidden states [rows, hidden] of an accepted step (a view valid until the next
        run)."""
        rows = len(step.query_lens)
        table = np.zeros((rows, self.max_blocks), dtype=np.int32)
        table[:, :step.block_table.shape[1]] = step.block_table
        batch = {"input_ids": torch.from_numpy(input_ids),
                 "positions": torch.from_numpy(positions),
                 "slot_mapping": torch.from_numpy(step.slot_mapping),
                 "seq_lens": torch.from_numpy(step.context_lens.astype(np.int32)),
                 "block_tables": torch.from_numpy(table)}
        hidden = self.graphs.run(batch)
        if hidden is None:
            raise ValueError(f"a step of {rows} rows is above the largest captured size "
                             f"{self.graphs.max_size} (accepts() says so first)")
        self.num_replays += 1
        return hidden
