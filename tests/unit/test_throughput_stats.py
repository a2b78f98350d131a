"""bench.throughput reports the timed run's counters, not the engine's totals since start."""

from treadle.bench.throughput import _stats_delta


def test_every_counter_is_the_timed_runs_own():
    before = {"num_steps": 10, "mean_tokens_per_step": 4.0, "mean_batch_size": 2.0,
              "batch_slot_efficiency": 0.5, "time_forward_s": 1.0, "time_swap_s": 4.0,
              "time_propose_s": 1.5, "swap_bytes_out": 100, "num_preemptions_swap": 2,
              "prefix_cache_hit_tokens": 7, "spec_num_drafts": 3, "num_kv_blocks": 64,
              "num_swapped": 1, "kv_usage": 0.25, "spec_acceptance_rate": 0.5}
    after = {"num_steps": 30, "mean_tokens_per_step": 6.0, "mean_batch_size": 3.0,
             "batch_slot_efficiency": 0.75, "time_forward_s": 5.0, "time_swap_s": 4.5,
             "time_propose_s": 1.5, "swap_bytes_out": 400, "num_preemptions_swap": 5,
             "prefix_cache_hit_tokens": 9, "spec_num_drafts": 8, "num_kv_blocks": 64,
             "num_swapped": 0, "kv_usage": 0.5, "spec_acceptance_rate": 0.6}
    d = _stats_delta(before, after)
    assert d["num_steps"] == 20
    assert d["time_forward_s"] == 4.0 and d["time_swap_s"] == 0.5 and d["time_propose_s"] == 0.0
    assert d["swap_bytes_out"] == 300 and d["num_preemptions_swap"] == 3
    assert d["prefix_cache_hit_tokens"] == 2 and d["spec_num_drafts"] == 5
    # States stay as they are at the end of the run.
    assert d["num_kv_blocks"] == 64 and d["num_swapped"] == 0 and d["kv_usage"] == 0.5
    assert d["spec_acceptance_rate"] == 0.6
    # Means over the timed steps only: (6 * 30 - 4 * 10) / 20.
    assert d["mean_tokens_per_step"] == 7.0
