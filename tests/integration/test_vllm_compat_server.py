"""`treadle serve` as routers built for vLLM see it: vLLM's metric names on /metrics (each
with vLLM's type and labels, its value the treadle twin's), and KV events from the
server's engine that KVEventIndex turns into the prefix hit the server then reports.
One server for the module (a tiny demo model, LoRA on so vllm:lora_requests_info shows).
"""

from __future__ import annotations

import uuid

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_fixtures import running_server, TINY_DEMO
from treadle.models.demo import write_demo_model


VLLM_TWINS = {
    # vLLM name: (type, treadle twin)
    "vllm:num_requests_running": ("gauge", "treadle:num_requests_running"),
    "vllm:kv_cache_usage_perc": ("gauge", "treadle:kv_cache_usage_perc"),
    "vllm:gpu_cache_usage_perc": ("gauge", "treadle:kv_cache_usage_perc"),
    "vllm:num_preemptions": ("counter", "treadle:num_preemptions"),
    "vllm:prompt_tokens": ("counter", "treadle:prompt_tokens"),
    "vllm:generation_tokens": ("counter", "treadle:generation_tokens"),
    "vllm:request_success": ("counter", "treadle:request_success"),
    "vllm:prefix_cache_queries": ("counter", "treadle:prefix_cache_queries"),
    "vllm:prefix_cache_hits": ("counter", "treadle:prefix_cache_hits"),
    "vllm:iteration_tokens_total": ("histogram", "treadle:iteration_tokens_total"),
    "vllm:time_to_first_token_seconds": ("histogram", "treadle:time_to_first_token_seconds"),
    "vllm:inter_token_latency_seconds": ("histogram", "treadle:inter_token_latency_seconds"),
    "vllm:time_per_output_token_seconds": ("histogram",
                                           "treadle:inter_token_latency_seconds"),
    "vllm:request_time_per_output_token_seconds": ("histogram",
                                                   "treadle:time_per_output_token_seconds"),
    "vllm:e2e_request_latency_seconds": ("histogram", "treadle:e2e_request_latency_seconds"),
    "vllm:request_queue_time_seconds": ("histogram", "treadle:request_queue_time_seconds"),
    "vllm:request_inference_time_seconds": ("histogram",
                                            "treadle:request_inference_time_seconds"),
    "vllm:request_prefill_time_seconds": ("histogram", "treadle:request_prefill_time_seconds"),
    "vllm:request_decode_time_seconds": ("histogram", "treadle:request_decode_time_seconds"),
    "vllm:request_prompt_tokens": ("histogram", "treadle:request_prompt_tokens"),
    "vllm:request_generation_tokens": ("histogram", "treadle:request_generation_tokens"),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm-compat")
    model = str(write_demo_model(path / "m", seed=5, config_overrides=TINY_DEMO))
    endpoint = f"ipc://{path}/pub-{uuid.uuid4().hex[:6]}"
    replay = f"ipc://{path}/replay-{uuid.uuid4().hex[:6]}"
    with running_server(model, "--num-kv-blocks", "256", "--block-size", "16",
                        "--enable-lora", "--max-loras", "2",
                        "--kv-events-endpoint", endpoint,
                        "--kv-events-replay-endpoint", replay,
                        "--kv-events-topic", "kv@pod@tiny") as (base, _):
        yield base, endpoint, replay


def scrape(base: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(httpx.get(base + "/metrics").text)}


def samples(family) -> dict:
    """(sample name without the family prefix, labels without `engine`) -> value."""
    return {(s.name[len(family.name):], tuple(sorted((k, v) for k, v in s.labels.items()
                                                     if k != "engine"))): s.value
            for s in family.samples if not s.name.endswith("_created")}


def test_vllm_names_types_labels_and_values(server):
    base, _, _ = server
    for i in range(3):
        r = httpx.post(base + "/v1/completions", json={
            "model": "tiny", "prompt": "the same long prefix for every request " * 3 + str(i),
            "max_tokens": 4, "temperature": 0}, timeout=60)
        assert r.status_code == 200
    families = scrape(base)
    for name, (kind, twin) in VLLM_TWINS.items():
        family = families.get(name)
        assert family is not None, f"{name} missing"
        assert family.type == kind, name
        for s in family.samples:
            assert s.labels["engine"] == "0" and s.labels["model_name"] == "tiny", name
        assert samples(family) == samples(families[twin]), name
    success = families["vllm:request_success"]
    assert {s.labels["finished_reason"] for s in success.samples} == {"length"}
    assert samples(families["vllm:prompt_tokens"])[("_total", (("model_name", "tiny"),))] > 0
    waiting = families["vllm:num_requests_waiting"]
    assert waiting.type == "gauge"
    (sample,) = waiting.samples
    assert sample.labels == {"model_name": "tiny", "engine": "0"}
    assert sample.value == sum(s.value for n in ("treadle:num_requests_waiting",
                                                 "treadle:num_requests_swapped")
                               for s in families[n].samples)
    (info,) = families["vllm:cache_config_info"].samples
    assert info.value == 1 and info.labels["block_size"] == "16"
    assert info.labels["num_gpu_blocks"] == "256" and info.labels["engine"] == "0"
    assert info.labels["enable_prefix_caching"] == "True"
    (lora,) = families["vllm:lora_requests_info"].samples
    assert lora.labels == {"max_lora": "2", "running_lora_adapters": "",
                           "waiting_lora_adapters": ""}
    assert lora.value > 1e9  # the time of the last update, as vLLM sets it


def test_kv_events_from_the_server_predict_its_prefix_hits(server):
    from treadle.kv_events.index import KVEventIndex

    base, endpoint, replay = server
    prompt = "a prefix the router will find again, " * 6
    first = httpx.post(base + "/v1/completions", json={
        "model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}, timeout=60)
    assert first.status_code == 200
    ids = httpx.post(base + "/tokenize", json={"model": "tiny", "prompt": prompt + "!"}
                     ).json()["tokens"]
    index = KVEventIndex(topic="kv@")
    try:
        index.add_replica("pod", endpoint, replay)  # catches up by replay
        deadline = 50
        while index.last_seq("pod") < 1 and deadline:
            deadline -= 1
            index.wait_for("pod", 1, timeout=0.2)
        # An open server's requests belong to the tenant "default": their salt.
        predicted = index.longest_prefix("pod", ids, cache_salt="default")
        assert predicted > 0 and index.longest_prefix("pod", ids) == 0
        again = httpx.post(base + "/v1/completions", json={
            "model": "tiny", "prompt": prompt + "!", "max_tokens": 1}, timeout=60).json()
        cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == predicted
    finally:
        index.close()
