"""The GPU path's start-up and decode pieces, run on CPU: decode steps replayed through
worker/cuda/decode_graphs.py (with cuda_graphs.ReplayByCall in place of a CUDA capture, the
triton backend under triton's interpreter) give the eager engine's tokens; the profiling
step; the platform's KV budget and swap copies; the GPU flags' validation."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="the triton extra is not installed "
                                     "(pip install -e '.[triton]')")

from conftest import make_tiny_checkpoint  # noqa: E402

from treadle import LLM, SamplingParams  # noqa: E402
from treadle.config import CacheConfig, ModelConfig  # noqa: E402
from treadle.worker.cuda.cuda_graphs import ReplayByCall  # noqa: E402
from treadle.worker.kv_cache import _copy_blocks_across, copy_blocks  # noqa: E402
from treadle.worker.cpu.platform import CPU  # noqa: E402
from treadle.worker.device import get_platform  # noqa: E402
from treadle.worker.profile_step import profile_lengths, profile_steps  # noqa: E402

PLATFORM = get_platform("auto")


def _llm(model_dir, **overrides):
    settings = dict(model=model_dir, dtype="float32", num_kv_blocks=64, block_size=4,
                    max_num_batched_tokens=16, attention_backend="triton",
                    device=PLATFORM.name, enforce_eager=True)
    return LLM(**{**settings, **overrides})


@pytest.mark.triton
def test_decode_graphs_give_the_eager_tokens(tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path / "tiny", "llama")
    # Five requests: decode steps of 5, 4, ... rows pad to the captured 8 or 4 (and 2, 1).
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (1, 7, 20, 3, 11)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    eager = _llm(model_dir)
    expected = [list(o.outputs[0].token_ids)
                for o in eager.generate(prompts, params, use_tqdm=False)]
    graphed = _llm(model_dir)
    worker = graphed.engine.executor.worker
    capture = ReplayByCall()
    worker.enable_decode_graphs([1, 2, 4, 8], capture)
    assert capture.captured_rows == [8, 4, 2, 1]  # largest first
    got = [list(o.outputs[0].token_ids) for o in graphed.generate(prompts, params,
                                                                   use_tqdm=False)]
    assert got == expected
    assert worker.runner.decode_graphs.num_replays >= 4


@pytest.mark.triton
@torch.inference_mode()
def test_padding_rows_touch_no_cache_block(tmp_path):
    """A decode step of 3 rows replayed at size 4: the same hidden states and cache as
    the eager forward pass, and every block the rows do not own unchanged."""
    model_dir = make_tiny_checkpoint(tmp_path / "tiny", "llama")
    llm = _llm(model_dir)
    worker = llm.engine.executor.worker
    worker.enable_decode_graphs([4], ReplayByCall())
    graphs, runner = worker.runner.decode_graphs, worker.runner
    from treadle.layers.attention import AttentionStep

    # Rows with contexts of 5, 9 and 2 tokens in blocks (0, 1), (2, 3, 4), (5,).
    table = np.array([[0, 1, 0], [2, 3, 4], [5, 0, 0]], dtype=np.int64)
    context = np.array([5, 9, 2], dtype=np.int64)
    slots = np.array([1 * 4 + 0, 4 * 4 + 0, 5 * 4 + 1], dtype=np.int64)
    step = AttentionStep(np.ones(3, dtype=np.int64), np.arange(3, dtype=np.int64),
                         context - 1, table, slots, 3, 4, runner.num_cache_blocks)
    ids, positions = np.array([5, 6, 7]), (context - 1).astype(np.int64)
    generator = torch.Generator().manual_seed(0)
    for cache in runner.kv_caches:
        cache.copy_(torch.randn(cache.shape, generator=generator))
    before = [c.clone() for c in runner.kv_caches]
    assert graphs.accepts(step)
    hidden = graphs.run(ids, positions, step).clone()
    graphed_cache = [c.clone() for c in runner.kv_caches]
    for cache, old in zip(runner.kv_caches, before):
        cache.copy_(old)
    meta = runner.attention.build_metadata(step, runner.device)
    eager = worker.model(torch.from_numpy(ids), torch.from_numpy(positions),
                         runner.kv_caches, meta)
    torch.testing.assert_close(hidden, eager, atol=1e-5, rtol=1e-5)
    for new, eager_cache, old in zip(graphed_cache, runner.kv_caches, before):
        # the rows' own slots as eager writes them, to float rounding (a later layer's K/V
        # come from hidden states of a padded batch); every other slot untouched
        torch.testing.assert_close(new, eager_cache, atol=1e-5, rtol=1e-5)
        changed = (new != old).movedim(worker.kv_spec.block_dim, 0).flatten(1).any(dim=1)
        assert set(torch.nonzero(changed).flatten().tolist()) == {1, 4, 5}


@pytest.mark.triton
def test_graphs_refuse_prefill_and_oversized_steps(tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path / "tiny", "llama")
    worker = _llm(model_dir).engine.executor.worker
    worker.enable_decode_graphs([2], ReplayByCall())
    from treadle.layers.attention import AttentionStep

    def step(q_lens):
        q = np.array(q_lens, dtype=np.int64)
        return AttentionStep(q, np.concatenate([[0], np.cumsum(q)[:-1]]).astype(np.int64),
                             np.zeros(len(q), np.int64), np.zeros((len(q), 1), np.int64),
                             np.zeros(int(q.sum()), np.int64), int((q == 1).sum()), 4, 64)
    graphs = worker.runner.decode_graphs
    assert graphs.accepts(step([1, 1])) and not graphs.accepts(step([1, 1, 1]))
    assert not graphs.accepts(step([1, 3]))


def test_profile_step_covers_the_largest_step(tmp_path):
    assert profile_lengths(512, 128, 2048) == [4] * 128
    assert profile_lengths(10, 4, 2048) == [3, 3, 2, 2]
    assert profile_lengths(3, 128, 2048) == [1, 1, 1]
    assert profile_lengths(4096, 1, 1024) == [1024]  # a row stays within the context
    step, finish, blocks = profile_steps([5, 3], 4, 100)
    assert blocks == 3 and [s.new_block_ids for s in step.scheduled] == [[0, 1], [2]]
    assert all(s.sample for s in step.scheduled)
    assert finish.finished_request_ids == ["profile-0", "profile-1"]
    # The step runs through the worker (on a GPU its peak sizes the KV cache).
    model_dir = make_tiny_checkpoint(tmp_path / "tiny", "llama")
    llm = LLM(model=model_dir, dtype="float32", num_kv_blocks=64, block_size=4,
              max_num_batched_tokens=32, max_num_seqs=3)
    llm.engine.executor.worker._profile_step()
    out = llm.generate([{"prompt_token_ids": [3, 4, 5]}],
                       SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_cpu_platform_budget_and_copies():
    calls = []
    assert CPU.kv_cache_bytes(123, lambda: calls.append(1), 0.9) == 123
    assert calls == []  # the CPU's budget is configured, never profiled
    done = []
    wait = CPU.start_copies(lambda: done.append(1))
    assert done == [1] and wait() is None
    assert not CPU.supports_cuda_graphs


@pytest.mark.parametrize("block_dim", [0, 2])
def test_copies_across_devices_move_the_same_blocks(block_dim):
    """The per-block path used between the GPU and pinned host memory copies what the
    gathering path copies (both checked on host tensors)."""
    shape = [2, 3, 4, 5] if block_dim == 2 else [6, 2, 4, 5]  # blocks: 4 or 6
    generator = torch.Generator().manual_seed(1)
    src = [torch.randn(shape, generator=generator) for _ in range(2)]
    pairs = [(0, 2), (3 if block_dim == 2 else 5, 0)]
    a = [torch.zeros(shape) for _ in range(2)]
    b = [torch.zeros(shape) for _ in range(2)]
    assert copy_blocks(src, a, pairs, block_dim) == _copy_blocks_across(src, b, pairs,
                                                                        block_dim)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=0, rtol=0)


def test_gpu_flags_are_validated():
    assert ModelConfig(cuda_graph_sizes="8,1,4").cuda_graph_sizes == (1, 4, 8)
    with pytest.raises(ValueError, match="cuda_graph_sizes"):
        ModelConfig(cuda_graph_sizes="1,x")
    with pytest.raises(ValueError, match="cuda_graph_sizes"):
        ModelConfig(cuda_graph_sizes="0,2")
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        CacheConfig(gpu_memory_utilization=0)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        CacheConfig(gpu_memory_utilization=1.5)
