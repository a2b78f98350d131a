"""treadle on Ray Serve (treadle/integrations/ray_serve): `build_openai_app` on a local Ray
cluster (2 CPUs, the tiny model of replica_fixtures.py, two engine replicas). Greedy
completions through Ray Serve's HTTP proxy and treadle's OpenAI routes equal one
engine's; a replica killed is replaced by Ray Serve and requests reach it again; the P/D
application with an adapter given at start gives one engine's texts too."""

from __future__ import annotations

import time

import httpx
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from replica_fixtures import OPTIONS, tiny_model  # noqa: E402
from server_fixtures import free_port  # noqa: E402
from treadle.sampling_params import SamplingParams  # noqa: E402

pytestmark = pytest.mark.ray

PROMPTS = [[5, 6, 7, 8 + i, 9] * (i + 1) for i in range(4)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def app(tiny):
    from treadle.integrations.ray_serve import build_openai_app

    ray.init(num_cpus=2, include_dashboard=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    handle = serve.run(build_openai_app(dict(model=tiny, **OPTIONS), num_replicas=2,
                                        routing="round-robin", served_model_name="tiny"),
                       name="treadle", route_prefix="/")
    yield f"http://127.0.0.1:{port}", handle
    serve.shutdown()
    ray.shutdown()


def complete(base: str, prompt: list[int], max_tokens: int = 8) -> dict:
    r = httpx.post(base + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def replica_tokens(base: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(base + "/metrics", timeout=30).text.splitlines():
        if line.startswith("treadle:generation_tokens_total{"):
            replica = line.split('replica="')[1].split('"')[0]
            out[replica] = out.get(replica, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def test_greedy_outputs_through_ray_serve_equal_one_engine(tiny, app):
    from treadle import LLM

    base, _ = app
    got = [complete(base, p)["choices"][0]["text"] for p in PROMPTS]
    llm = LLM(model=tiny, **OPTIONS)
    want = [o.outputs[0].text for o in llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)]
    del llm
    assert got == want
    assert set(replica_tokens(base)) == {"0", "1"}  # round-robin: both replicas served


def test_killed_replica_is_replaced_and_routed_to_again(app):
    base, _ = app
    from ray.serve.context import _get_global_client  # noqa: F401 - Serve is up

    actors = [a for a in ray.util.list_named_actors(all_namespaces=True)
              if "TreadleEngine" in a["name"]]
    assert len(actors) == 2
    killed_at = time.monotonic()
    ray.kill(ray.get_actor(actors[0]["name"], namespace=actors[0]["namespace"]),
             no_restart=True)
    # requests keep being served meanwhile (the live replica; a call that finds the dead
    # one before Ray Serve drops it is sent again)
    for p in PROMPTS:
        assert complete(base, p, 4)["usage"]["completion_tokens"] == 4
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if "TreadleEngine" in a["name"]}
        status = serve.status().applications["treadle"].deployments["TreadleEngine"]
        if len(names) == 2 and actors[0]["name"] not in names \
                and status.status == "HEALTHY":
            break
        time.sleep(0.5)
    else:
        pytest.fail("Ray Serve did not replace the killed replica")
    recovered_s = time.monotonic() - killed_at
    before = replica_tokens(base)
    for p in PROMPTS:  # round-robin: the new replica takes its share
        complete(base, p, 4)
    after = replica_tokens(base)
    assert all(after.get(r, 0) - before.get(r, 0) >= 4 for r in ("0", "1")), (before, after)
    print(f"\nray serve: replica replaced and routed to {recovered_s:.1f} s after the kill")


def test_pd_app_with_an_adapter_equals_one_engine(tiny, app, tmp_path):
    """The same application shape with P/D (a prefill and a decode deployment, the decode
    one fetching KV through the prefill one's handle) and an adapter from the start: its
    greedy texts, with and without the adapter, are one engine's."""
    pytest.importorskip("peft")
    from lora_adapters import make_adapter

    from treadle import LLM, LoRARequest
    from treadle.integrations.ray_serve import build_openai_app

    base, _ = app
    serve.delete("treadle")  # its two replicas' CPUs for these two
    adapter = make_adapter(tiny, tmp_path / "a0", 4, seed=1)
    serve.run(build_openai_app(dict(model=tiny, enable_lora=True, max_lora_rank=8, **OPTIONS),
                               prefill_replicas=1, decode_replicas=1, served_model_name="tiny",
                               lora_modules=[("a0", adapter)]),
              name="treadle-pd", route_prefix="/")
    prompts = [[5, 6, 7, 8, 9] * 5, [11, 12, 13] * 9]
    got = [complete(base, p)["choices"][0]["text"] for p in prompts]
    got_a0 = httpx.post(base + "/v1/completions", timeout=120, json={
        "model": "a0", "prompt": prompts[0], "max_tokens": 8, "temperature": 0,
        "ignore_eos": True}).json()["choices"][0]["text"]
    llm = LLM(model=tiny, enable_lora=True, max_lora_rank=8, **OPTIONS)
    want = [o.outputs[0].text for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts + prompts[:1]],
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False,
        lora_request=[None, None, LoRARequest("a0", 1, adapter)])]
    llm.engine.shutdown()
    assert got + [got_a0] == want
    assert got_a0 != got[0]
    tokens = replica_tokens(base)
    assert tokens.get("1", 0) > 0  # the decode replica (index 1) generated
