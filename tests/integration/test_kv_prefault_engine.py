"""The worker keeps the KV prefaulter (worker/cpu/kv_prefault.py) ahead of the blocks the
scheduler hands out: after a run, every block the steps used and a huge page's worth past
the highest are resident, from the step messages alone."""

from __future__ import annotations

import pytest
from conftest import make_tiny_checkpoint

from treadle.config import EngineConfig
from treadle.engine.core import EngineCore
from treadle.request import Request
from treadle.sampling_params import SamplingParams


def test_the_worker_moves_the_prefaulter_past_the_blocks_in_use(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "tiny", "llama")
    core = EngineCore(EngineConfig.from_options(
        model=str(path), dtype="bfloat16", kv_cache_memory="64MiB", block_size=16,
        distributed_executor_backend="uni", enable_prefix_caching=False))
    worker = core.executor.worker
    prefaulter = worker.kv_prefaulter
    assert prefaulter is not None, "a CPU worker on Linux keeps one"
    assert prefaulter.wait_idle(30)
    if prefaulter.failed:
        pytest.skip(f"this kernel refuses MADV_POPULATE_WRITE ({prefaulter.failed})")
    start = prefaulter.populated_blocks
    assert start == min(prefaulter.num_blocks, prefaulter.ahead_blocks)
    for i in range(24):  # 24 prompts of 199 tokens: ~300 fresh blocks, taken in id order
        core.add_request(Request(f"r{i}", list(range(1, 200)), SamplingParams(
            max_tokens=8, temperature=0.0, ignore_eos=True)))
    while core.has_unfinished_requests():
        core.step()
    highest = worker.runner.batch.highest_block_id
    assert highest >= 24 * 200 // 16 - 1  # fresh ids in order: no prefix reuse
    assert prefaulter.wait_idle(30)
    assert prefaulter.populated_blocks == min(prefaulter.num_blocks,
                                              highest + 1 + prefaulter.ahead_blocks)
