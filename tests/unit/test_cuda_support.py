"""The CUDA platform's sizing functions (worker/cuda/cuda_support.py) and the CUDA-graph
runner's buffer logic (worker/cuda/cuda_graphs.py) with a fake capture: no GPU needed."""

from __future__ import annotations

import logging

import pytest
import torch

from treadle.worker.cuda.cuda_graphs import CudaGraphRunner, ReplayByCall, StaticInput
from treadle.worker.cuda.cuda_support import (GIB, MemorySnapshot, bytes_per_block,
                                         check_cuda_graph_sizes, check_free_at_start,
                                         default_cuda_graph_sizes, kv_cache_bytes,
                                         num_kv_blocks, padded_batch_size, swap_space_blocks)


def test_default_graph_sizes():
    assert default_cuda_graph_sizes(1) == [1, 2, 4, 8]
    assert default_cuda_graph_sizes(8) == [1, 2, 4, 8]
    assert default_cuda_graph_sizes(20) == [1, 2, 4, 8, 16, 24]
    sizes = default_cuda_graph_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 35


@pytest.mark.parametrize("num_reqs, expected", [(1, 1), (3, 4), (4, 4), (5, 8), (9, 16),
                                                (64, 64), (65, None), (1000, None)])
def test_padded_batch_size(num_reqs, expected):
    assert padded_batch_size(num_reqs, [1, 2, 4, 8, 16, 32, 64]) == expected


@pytest.mark.parametrize("sizes", [[], [0, 4], [2, 2], ["8"], [True], "1,2"])
def test_bad_graph_sizes_name_the_field(sizes):
    with pytest.raises(ValueError, match="cuda_graph_sizes"):
        check_cuda_graph_sizes(sizes)
    assert check_cuda_graph_sizes([8, 1, 4]) == [1, 4, 8]


def test_kv_budget_from_the_profiled_peak():
    # an 80 GiB card; after profiling: 20 GiB free, torch holds 58 GiB reserved with a
    # 55 GiB peak; so 2 GiB are the CUDA context and workspaces outside torch
    snap = MemorySnapshot(total_bytes=80 * GIB, free_bytes=20 * GIB,
                          torch_reserved_bytes=58 * GIB, torch_peak_bytes=55 * GIB)
    assert snap.non_torch_bytes == 2 * GIB
    assert snap.used_bytes == 57 * GIB
    assert kv_cache_bytes(snap, 0.9) == int(72 * GIB) - 57 * GIB
    per_block = bytes_per_block(num_layers=16, num_kv_heads=8, head_dim=64, dtype_bytes=2,
                                block_size=16)
    assert per_block == 2 * 16 * 8 * 64 * 2 * 16 == 512 * 1024
    assert num_kv_blocks(15 * GIB, per_block) == 15 * 2048
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_cache_bytes(snap, 0.7)  # 56 GiB allowed < 57 used
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_cache_bytes(snap, 1.5)
    with pytest.raises(ValueError, match="max_model_len"):
        num_kv_blocks(10 * per_block, per_block, min_blocks=11)


def test_start_refused_when_others_hold_the_memory():
    check_free_at_start(80 * GIB, 75 * GIB, 0.9)
    with pytest.raises(ValueError, match="at most 0.50"):
        check_free_at_start(80 * GIB, 40 * GIB, 0.9)


def test_swap_space_bounds(caplog):
    assert swap_space_blocks(4 * GIB, GIB // 4, 64 * GIB) == 16
    with caplog.at_level(logging.WARNING):
        assert swap_space_blocks(32 * GIB, GIB, 64 * GIB) == 32
    assert "pins 50%" in caplog.text
    with pytest.raises(ValueError, match="swap_space"):
        swap_space_blocks(50 * GIB, GIB, 64 * GIB)


def make_runner(sizes=(1, 2, 4, 8)):
    calls = []

    def step(inputs):
        calls.append({k: v.clone() for k, v in inputs.items()})
        # a step that reads every input row: token * 10 + seq_len, masked by seq_len > 0
        return (inputs["tokens"] * 10 + inputs["seq_lens"]) * (inputs["seq_lens"] > 0)

    specs = [StaticInput("tokens", (), torch.int64, 0),
             StaticInput("seq_lens", (), torch.int32, 0)]
    capture = ReplayByCall()
    runner = CudaGraphRunner(step, specs, list(sizes), "cpu", capture=capture)
    return runner, capture, calls


def test_graph_runner_captures_largest_first_and_pads():
    runner, capture, calls = make_runner()
    with pytest.raises(RuntimeError, match="capture_all"):
        runner.run({"tokens": torch.tensor([1]), "seq_lens": torch.tensor([1], dtype=torch.int32)})
    runner.capture_all()
    assert capture.captured_rows == [8, 4, 2, 1] and runner.captured_sizes == [1, 2, 4, 8]
    out = runner.run({"tokens": torch.tensor([5, 6, 7]),
                      "seq_lens": torch.tensor([3, 4, 9], dtype=torch.int32)})
    assert out.tolist() == [53, 64, 79]
    seen = calls[-1]
    assert seen["tokens"].shape[0] == 4 and seen["tokens"][3] == 0 and seen["seq_lens"][3] == 0


def test_graph_runner_repads_rows_a_bigger_batch_left():
    runner, _, calls = make_runner()
    runner.capture_all()
    runner.run({"tokens": torch.arange(1, 8), "seq_lens": torch.full((7,), 2, dtype=torch.int32)})
    out = runner.run({"tokens": torch.tensor([9, 9, 9]),
                      "seq_lens": torch.tensor([1, 1, 1], dtype=torch.int32)})
    assert out.tolist() == [91, 91, 91]
    assert calls[-1]["seq_lens"].tolist() == [1, 1, 1, 0]  # row 3 of the last batch re-padded
    # the size-8 buffers beyond row 4 still hold the 7-row batch: the next 8-row replay must
    # pad them again
    out = runner.run({"tokens": torch.tensor([4] * 5), "seq_lens": torch.ones(5, dtype=torch.int32)})
    assert calls[-1]["seq_lens"].tolist() == [1] * 5 + [0] * 3
    assert out.tolist() == [41] * 5


def test_graph_runner_reads_the_captured_buffers_and_refuses_oversize():
    runner, _, _ = make_runner()
    runner.capture_all()
    ptrs = {k: v.data_ptr() for k, v in runner.buffers.items()}
    runner.run({"tokens": torch.tensor([1, 2]), "seq_lens": torch.ones(2, dtype=torch.int32)})
    assert {k: v.data_ptr() for k, v in runner.buffers.items()} == ptrs
    assert runner.run({"tokens": torch.arange(9),
                       "seq_lens": torch.ones(9, dtype=torch.int32)}) is None
    with pytest.raises(ValueError, match="differ"):
        runner.run({"tokens": torch.tensor([1])})
    with pytest.raises(ValueError, match="row counts"):
        runner.run({"tokens": torch.tensor([1, 2]), "seq_lens": torch.ones(1, dtype=torch.int32)})
