"""CUDA-graph capture and replay of a step function at a fixed set of batch sizes.

Owns the static input buffers (one per input, allocated once at the largest size; the
graph of each size reads views of their first rows), the capture of one graph per size
(largest first, so that the smaller graphs reuse the shared pool's memory), and a replay:
copy the batch's inputs into the buffers, fill the padding rows up to the captured size
with each input's pad value, replay, return the output's real rows. A batch above the
largest size is not run (run() returns None: the caller runs it eagerly).

The capture itself is a parameter: `TorchGraphCapture` on a GPU; `ReplayByCall` replays by
calling the function again over the same static buffers, which checks every part of the
buffer logic without a GPU (tests, CPU smoke runs of benchmarks/gpu/). It does not choose
which steps may use a graph (decode-only steps; the runner decides) and it never changes a
buffer's storage after capture: a graph reads fixed addresses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from treadle.worker.cuda.cuda_support import check_cuda_graph_sizes, padded_batch_size

StepFn = Callable[[dict[str, torch.Tensor]], torch.Tensor]


@dataclass(frozen=True)
class StaticInput:
    """One batch-major input of the captured function."""

    name: str
    row_shape: tuple[int, ...]
    """Shape of one row (the batch dimension excluded)."""
    dtype: torch.dtype
    pad_value: int | float
    """What padding rows hold: a value the function treats as inert (seq_len 0, a
    negative slot for the K/V write, token id 0)."""


class Capture(Protocol):
    def __call__(self, fn: Callable[[], torch.Tensor]
                 ) -> tuple[Callable[[], None], torch.Tensor]:
        """Capture fn; return (replay, the output tensor every replay writes)."""


class TorchGraphCapture:
    """torch.cuda.CUDAGraph capture, one memory pool shared by every size."""

    def __init__(self, warmup_runs: int = 2) -> None:
        self.warmup_runs = warmup_runs
        self.pool = None
        self.graphs: list[torch.cuda.CUDAGraph] = []

    def __call__(self, fn: Callable[[], torch.Tensor]
                 ) -> tuple[Callable[[], None], torch.Tensor]:
        # Eager runs first, on a side stream as torch's docs ask: Triton's JIT, cuBLAS
        # handles and lazy allocations must happen outside the graph.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.warmup_runs):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = fn()
        self.graphs.append(graph)
        return graph.replay, output


class ReplayByCall:
    """A stand-in for graph capture where there is no GPU (tests, CPU smoke runs): replay
    calls the function again over the very buffers it was captured with and writes the
    result into the output of the first call, as a graph writes fixed addresses."""

    def __init__(self) -> None:
        self.captured_rows: list[int] = []

    def __call__(self, fn: Callable[[], torch.Tensor]
                 ) -> tuple[Callable[[], None], torch.Tensor]:
        output = fn()
        self.captured_rows.append(output.shape[0])

        def replay() -> None:
            output.copy_(fn())
        return replay, output


class CudaGraphRunner:
    """Captured graphs of `fn` at each of `sizes` over shared static input buffers."""

    def __init__(self, fn: StepFn, inputs: list[StaticInput], sizes: list[int],
                 device: torch.device | str, capture: Capture | None = None) -> None:
        self.fn = fn
        self.sizes = check_cuda_graph_sizes(list(sizes))
        self.inputs = {spec.name: spec for spec in inputs}
        if len(self.inputs) != len(inputs):
            raise ValueError(f"input names must be unique, got {[s.name for s in inputs]}")
        self.capture = capture if capture is not None else TorchGraphCapture()
        self.max_size = self.sizes[-1]
        self.buffers = {spec.name: torch.full((self.max_size, *spec.row_shape), spec.pad_value,
                                              dtype=spec.dtype, device=device)
                        for spec in inputs}
        self._graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        self._dirty_rows = 0
        """Rows [0, _dirty_rows) of the buffers may hold a past batch's data; the rows
        after them hold pad values."""

    @property
    def captured_sizes(self) -> list[int]:
        return sorted(self._graphs)

    def capture_all(self) -> None:
        """Capture one graph per size, largest first (its pool memory serves the rest)."""
        for size in reversed(self.sizes):
            views = {name: buf[:size] for name, buf in self.buffers.items()}
            self._graphs[size] = self.capture(lambda views=views: self.fn(views))
        self._dirty_rows = self.max_size  # warm-up and capture ran over every row

    def padded_size(self, num_rows: int) -> int | None:
        return padded_batch_size(num_rows, self.sizes)

    def run(self, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The output rows of `batch` by graph replay; None when it exceeds every size.

        batch: one tensor per input, [num_rows, *row_shape] (host or device memory).
        The returned tensor is a view of the graph's static output, valid until the
        next run().
        """
        if set(batch) != set(self.inputs):
            raise ValueError(f"batch inputs {sorted(batch)} differ from the captured "
                             f"{sorted(self.inputs)}")
        num_rows = {t.shape[0] for t in batch.values()}
        if len(num_rows) != 1:
            raise ValueError(f"batch inputs have different row counts: "
                             f"{ {k: v.shape[0] for k, v in batch.items()} }")
        (n,) = num_rows
        size = self.padded_size(n)
        if size is None:
            return None
        if size not in self._graphs:
            raise RuntimeError("capture_all() must run before run()")
        for name, tensor in batch.items():
            spec = self.inputs[name]
            if tuple(tensor.shape[1:]) != spec.row_shape:
                raise ValueError(f"input {name!r} rows must be {spec.row_shape}, "
                                 f"got {tuple(tensor.shape[1:])}")
            buf = self.buffers[name]
            buf[:n].copy_(tensor, non_blocking=True)
            if self._dirty_rows > n:
                buf[n:min(size, self._dirty_rows)].fill_(spec.pad_value)
        # rows past `size` keep whatever they held: this graph never reads them
        self._dirty_rows = self._dirty_rows if self._dirty_rows > size else n
        replay, output = self._graphs[size]
        replay()
        return output[:n]
