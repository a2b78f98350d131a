"""deploy/kubernetes: every manifest of a built-in kind validates against the Kubernetes
schemas (kubernetes-validate, which ships them: no network), strictly, at the oldest and
newest versions it knows from 1.30 on; the custom resources (InferencePool,
ServingRuntime, InferenceService) are checked here against what they point at. And the
pieces agree with treadle itself: the containers' arguments parse as `treadle serve`'s
and build its configs, the probes are /health and /ready, the llm-d endpoint picker's
engineConfigs entry and the HPA's adapter rule name metrics a treadle engine serves, and
the KV-events port, topic and block size are the engine's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")

from treadle.cli.serve import add_parser  # noqa: E402
from treadle.config import (CacheConfig, EngineConfig,  # noqa: E402
                            dataclass_from_args, options_from_args)
from treadle.metrics import EngineMetrics  # noqa: E402
from treadle.server.config import ServerConfig  # noqa: E402

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
CUSTOM_KINDS = {"InferencePool", "ServingRuntime", "InferenceService"}
POD_IP = "10.1.2.3"


def documents() -> dict[str, list[dict]]:
    files = sorted(DEPLOY.rglob("*.yaml"))
    assert files
    return {str(f.relative_to(DEPLOY)): [d for d in yaml.safe_load_all(f.read_text()) if d]
            for f in files}


def by_kind(kind: str) -> list[dict]:
    return [d for docs in documents().values() for d in docs if d["kind"] == kind]


def versions() -> list[str]:
    known = sorted(({".".join(v.split(".")[:2]) for v in _schema_versions()}),
                   key=lambda v: tuple(map(int, v.split("."))))
    supported = [v for v in known if tuple(map(int, v.split("."))) >= (1, 30)]
    return [supported[0] + ".0", supported[-1] + ".0"]


def _schema_versions() -> list[str]:
    root = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    return [p.name.lstrip("v").split("-")[0] for p in root.iterdir()
            if p.name.startswith("v") and p.name[1:2].isdigit()]


def test_built_in_kinds_validate_against_the_kubernetes_schemas():
    checked = 0
    for name, docs in documents().items():
        for doc in docs:
            if doc["kind"] in CUSTOM_KINDS:
                with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                    kubernetes_validate.validate(doc, versions()[-1], strict=True)
                continue
            for version in versions():
                kubernetes_validate.validate(doc, version, strict=True)
            checked += 1
    assert checked >= 5  # Deployment, Service, HPA and the two ConfigMaps


def test_validation_catches_a_broken_manifest():
    (deployment,) = by_kind("Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "x"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, versions()[-1], strict=True)


def serve_args(container: dict, substitutions: dict[str, str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = []
    for arg in container["args"]:
        for key, value in substitutions.items():
            arg = arg.replace(key, value)
        args.append(arg)
    return parser.parse_args(["serve", *args])


def test_the_deployment_runs_treadle_serve_with_kv_events_and_its_probes():
    (deployment,) = by_kind("Deployment")
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    args = serve_args(container, {"$(POD_IP)": POD_IP})
    config = EngineConfig.from_options(**options_from_args(args))
    server = dataclass_from_args(ServerConfig, args)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert server.port == ports["http"]
    events = config.kv_events
    assert events.kv_events_endpoint == f"tcp://*:{ports['kv-events']}"
    assert events.kv_events_replay_endpoint == f"tcp://*:{ports['kv-replay']}"
    assert events.kv_events_topic == f"kv@{POD_IP}@{server.served_model_name}"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert pod["metadata"]["labels"]["llm-d.ai/engine-type"] == "treadle"
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > \
        server.shutdown_timeout


def served_metric_names() -> set[str]:
    metrics = EngineMetrics("m")
    metrics.vllm.set_cache_config(block_size=16)
    metrics.vllm.set_max_lora(1)
    return {f.name for f in metrics.registry.collect()}


def test_llm_d_reads_metrics_and_events_treadle_serves():
    (config_map,) = [d for d in by_kind("ConfigMap") if "epp-config.yaml" in d["data"]]
    epp = yaml.safe_load(config_map["data"]["epp-config.yaml"])
    plugins = {p["type"]: p.get("parameters", {}) for p in epp["plugins"]}
    extractor = plugins["core-metrics-extractor"]
    (entry,) = [e for e in extractor["engineConfigs"] if e["name"] == "treadle"]
    served = served_metric_names()
    for key in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "loraSpec",
                "cacheInfoSpec"):
        assert entry[key] in served, key
    (deployment,) = by_kind("Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert labels[extractor["engineLabelKey"]] == "treadle"
    scorer = plugins["precise-prefix-cache-scorer"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    events = scorer["kvEventsConfig"]
    assert events["podDiscoveryConfig"]["socketPort"] == ports["kv-events"]
    args = serve_args(container, {"$(POD_IP)": POD_IP})
    config = EngineConfig.from_options(**options_from_args(args))
    assert config.kv_events.kv_events_topic.startswith(events["topicFilter"])
    assert scorer["tokenProcessorConfig"]["blockSize"] == config.cache.block_size == \
        CacheConfig().block_size
    referenced = {p["pluginRef"] for profile in epp["schedulingProfiles"]
                  for p in profile["plugins"]}
    assert referenced <= set(plugins)
    (pool,) = by_kind("InferencePool")
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [ports["http"]]


def test_the_hpa_scales_on_a_metric_treadle_serves():
    (hpa,) = by_kind("HorizontalPodAutoscaler")
    (deployment,) = by_kind("Deployment")
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    (metric,) = hpa["spec"]["metrics"]
    (rules,) = [d for d in by_kind("ConfigMap") if "config.yaml" in d["data"]]
    (rule,) = yaml.safe_load(rules["data"]["config.yaml"])["rules"]
    assert rule["name"]["as"] == metric["pods"]["metric"]["name"]
    source = rule["name"]["matches"].strip("^$")
    assert source in served_metric_names() and rule["seriesQuery"].startswith(source)


def test_kserve_runtime_runs_treadle_serve():
    (runtime,) = by_kind("ServingRuntime")
    (container,) = runtime["spec"]["containers"]
    args = serve_args(container, {"{{.Name}}": "smollm2-135m-instruct"})
    server = dataclass_from_args(ServerConfig, args)
    assert [p["containerPort"] for p in container["ports"]] == [server.port]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    (service,) = by_kind("InferenceService")
    assert service["spec"]["predictor"]["model"]["runtime"] == runtime["metadata"]["name"]
    formats = {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    assert service["spec"]["predictor"]["model"]["modelFormat"]["name"] in formats
