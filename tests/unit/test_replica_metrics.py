"""/metrics of a replica set: every replica's samples under a `replica` label, each metric
family once (the text format forbids a split family), the front end's own metrics too."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from treadle.distributed.metrics import FrontEndMetrics, merge_expositions
from treadle.metrics import EngineMetrics


def test_merge_labels_every_sample_and_keeps_families_whole():
    a, b = EngineMetrics("m"), EngineMetrics("m")
    a.prompt_tokens.inc(3)
    b.prompt_tokens.inc(5)
    a.ttft.observe(0.2)
    front = FrontEndMetrics("m")
    front.set_healthy(0, True)
    front.set_healthy(1, False)
    front.record_route(1, "prefix", 32)
    text = merge_expositions([(0, generate_latest(a.registry)),
                              (1, generate_latest(b.registry))], front.registry).decode()
    families = list(text_string_to_metric_families(text))
    names = [f.name for f in families]
    assert len(names) == len(set(names))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in families for s in f.samples}
    assert samples[("treadle:prompt_tokens_total",
                    (("model_name", "m"), ("replica", "0")))] == 3
    assert samples[("treadle:prompt_tokens_total",
                    (("model_name", "m"), ("replica", "1")))] == 5
    assert samples[("treadle:time_to_first_token_seconds_count",
                    (("model_name", "m"), ("replica", "0")))] == 1
    assert samples[("treadle:replica_healthy", (("model_name", "m"), ("replica", "1")))] == 0
    assert samples[("treadle:router_prefix_matched_tokens_total", (("model_name", "m"),))] == 32
    engine_samples = [s for f in families if f.name.startswith("treadle:prompt")
                      for s in f.samples]
    assert all("replica" in s.labels for s in engine_samples)
