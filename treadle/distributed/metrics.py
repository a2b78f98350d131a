"""/metrics of a replica set: every replica's exposition under a `replica` label, plus the
front end's own (replica health, routing decisions).

Owns parsing the replicas' Prometheus text, adding the label, and writing one exposition
in which each metric family appears once (the text format forbids a family split in
two). It never decides anything.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families


class FrontEndMetrics:
    """The front end's own metrics: which replicas are healthy, how requests were routed."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self._model = model_name
        self.healthy = Gauge("treadle:replica_healthy", "1 while the replica answers, else 0",
                             ["model_name", "replica"], registry=self.registry)
        self.routed = Counter("treadle:router_requests", "Requests routed, by replica and "
                              "reason (prefix, balance, round-robin, least-load)",
                              ["model_name", "replica", "reason"], registry=self.registry)
        self.matched = Counter("treadle:router_prefix_matched_tokens",
                               "Prompt tokens the router expected the chosen replica to hold",
                               ["model_name"], registry=self.registry)
        self.restarts = Counter("treadle:replica_deaths", "Replica actors seen dead",
                                ["model_name", "replica"], registry=self.registry)
        self.retried = Counter("treadle:replica_retried_requests",
                               "Requests whose replica died before their first output, sent "
                               "again to another replica (by the replica that died)",
                               ["model_name", "replica"], registry=self.registry)

    def set_healthy(self, replica: int, healthy: bool) -> None:
        self.healthy.labels(self._model, str(replica)).set(1 if healthy else 0)

    def record_route(self, replica: int, reason: str, matched_tokens: int) -> None:
        self.routed.labels(self._model, str(replica), reason).inc()
        if matched_tokens:
            self.matched.labels(self._model).inc(matched_tokens)

    def record_death(self, replica: int) -> None:
        self.restarts.labels(self._model, str(replica)).inc()

    def record_retry(self, replica: int) -> None:
        self.retried.labels(self._model, str(replica)).inc()


class _Families:
    """A collector yielding already-built metric families."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self):
        return iter(self._families)


def merge_expositions(per_replica: list[tuple[int, bytes | str]],
                      own: CollectorRegistry | None = None) -> bytes:
    """One exposition of every replica's metrics, each sample labelled `replica`, and the
    front end's own registry."""
    families: dict[str, Metric] = {}
    for replica, text in per_replica:
        if isinstance(text, bytes):
            text = text.decode()
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation,
                                                        family.type, family.unit)
            for sample in family.samples:
                merged.samples.append(sample._replace(
                    labels={**sample.labels, "replica": str(replica)}))
    if own is not None:
        for family in own.collect():
            families.setdefault(family.name, family)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)
