"""vllm:cache_config_info's labels (treadle/metrics_vllm.py) from an engine's config."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from treadle.config import CacheConfig
from treadle.metrics_vllm import cache_config_labels

CORE = SimpleNamespace(num_kv_blocks=100, num_swap_blocks=64, kv_bytes_per_token=1024)


@pytest.mark.parametrize("swap_space, gib", [
    ("auto", 64 * 16 * 1024 / 1024**3),  # the default: the size the engine settled on
    (2 * 1024**3, 2.0),
])
def test_swap_space_is_in_gib_whether_given_or_auto(swap_space, gib):
    """A server started with the default swap_space (auto) died building this label."""
    config = SimpleNamespace(cache=CacheConfig(block_size=16, swap_space=swap_space))
    labels = cache_config_labels(config, CORE)
    assert labels["swap_space"] == pytest.approx(gib)
    assert labels["num_gpu_blocks"] == 100 and labels["num_cpu_blocks"] == 64
