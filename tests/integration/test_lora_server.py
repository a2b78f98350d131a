"""Multi-LoRA over HTTP: `--enable-lora --lora-modules` at start, a request selects an
adapter by its model field (the same tokens as offline), /v1/models lists adapters with
their base as parent, vLLM's load / unload routes with --enable-lora-runtime-updates,
keys limited to some models (another tenant's adapter is the same 404 as one that does
not exist), and the LoRA routes pass schemathesis with every check."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from lora_adapters import make_adapter
from server_fixtures import running_server, TINY_DEMO
from treadle import LLM, LoRARequest, SamplingParams
from treadle.models.demo import write_demo_model

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

ADMIN, LIMITED = "key-admin", "key-limited"
H_ADMIN = {"Authorization": f"Bearer {ADMIN}"}
H_LIMITED = {"Authorization": f"Bearer {LIMITED}"}
PROMPT = [5, 17, 230, 41, 99, 7, 301, 12]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(model dir, {name: adapter dir}, keys file)."""
    root = tmp_path_factory.mktemp("lora-server")
    model_dir = str(write_demo_model(root / "m", seed=5, config_overrides=TINY_DEMO))
    adapters = {"a0": make_adapter(model_dir, root / "a0", 4, seed=1),
                "a1": make_adapter(model_dir, root / "a1", 8, seed=2),
                "big": make_adapter(model_dir, root / "big", 16, seed=3)}
    keys = root / "keys.yaml"
    keys.write_text(f"- {{key: {ADMIN}, tenant: admin}}\n"
                    f"- {{key: {LIMITED}, tenant: limited, models: [tiny, a0]}}\n")
    return model_dir, adapters, str(keys)


@pytest.fixture(scope="module")
def server(files):
    model_dir, adapters, keys = files
    with running_server(model_dir, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                        "--lora-modules", f"a0={adapters['a0']}",
                        "--enable-lora-runtime-updates", "--api-keys-file", keys) as (base, _):
        yield base


def complete(base, model, headers=H_ADMIN):
    return httpx.post(base + "/v1/completions", headers=headers, timeout=60, json={
        "model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
        "ignore_eos": True})


def tokens_of(response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def models(base, headers=H_ADMIN) -> dict:
    r = httpx.get(base + "/v1/models", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return {card["id"]: card for card in r.json()["data"]}


def post(base, path, body, headers=H_ADMIN):
    return httpx.post(base + path, json=body, headers=headers, timeout=60)


def test_an_adapter_from_the_command_line_serves_the_offline_tokens(server, files):
    model_dir, adapters, _ = files
    cards = models(server)
    assert cards["tiny"]["parent"] is None
    assert cards["a0"]["parent"] == "tiny" and cards["a0"]["root"] == "a0"  # no paths
    r = complete(server, "a0")
    assert r.json()["model"] == "a0"
    served = tokens_of(r)
    base_text = tokens_of(complete(server, "tiny"))
    assert served != base_text
    llm = LLM(model=model_dir, dtype="float32", enable_lora=True, max_lora_rank=8)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with_adapter, without = llm.generate(
        [{"prompt_token_ids": PROMPT}] * 2, params, use_tqdm=False,
        lora_request=[LoRARequest("a0", 1, adapters["a0"]), None])
    llm.engine.shutdown()
    assert served == with_adapter.outputs[0].text
    assert base_text == without.outputs[0].text


def test_load_and_unload_at_runtime(server, files):
    _, adapters, _ = files
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "a1", "lora_path": adapters["a1"]})
    assert r.status_code == 200 and "a1" in r.text
    assert models(server)["a1"]["parent"] == "tiny"
    assert tokens_of(complete(server, "a1")) != tokens_of(complete(server, "a0"))
    again = post(server, "/v1/load_lora_adapter", {"lora_name": "a1",
                                                    "lora_path": adapters["a1"]})
    assert again.status_code == 409 and again.json()["error"]["param"] == "lora_name"
    big = post(server, "/v1/load_lora_adapter", {"lora_name": "big",
                                                  "lora_path": adapters["big"]})
    assert big.status_code == 400 and "max_lora_rank" in big.json()["error"]["message"]
    missing = post(server, "/v1/load_lora_adapter", {"lora_name": "x",
                                                      "lora_path": "/nonexistent/adapter"})
    assert missing.status_code == 404
    extra = post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp",
                                                    "surprise": 1})
    assert extra.status_code == 400
    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "a1"})
    assert r.status_code == 200 and "a1" in r.text
    assert "a1" not in models(server)
    assert complete(server, "a1").status_code == 404
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "a1"}).status_code == 404


def test_a_key_limited_to_some_models_sees_only_those(server, files):
    _, adapters, _ = files
    assert post(server, "/v1/load_lora_adapter",
                {"lora_name": "secret", "lora_path": adapters["a1"]}).status_code == 200
    try:
        assert set(models(server, H_LIMITED)) == {"tiny", "a0"}
        assert {"tiny", "a0", "secret"} <= set(models(server))
        assert tokens_of(complete(server, "a0", H_LIMITED)) == tokens_of(complete(server, "a0"))
        hidden = complete(server, "secret", H_LIMITED)
        absent = complete(server, "nosuch", H_LIMITED)
        assert hidden.status_code == absent.status_code == 404
        assert hidden.json()["error"]["message"].replace("secret", "nosuch") == \
            absent.json()["error"]["message"]
        unload = post(server, "/v1/unload_lora_adapter", {"lora_name": "secret"}, H_LIMITED)
        assert unload.status_code == 404
        load = post(server, "/v1/load_lora_adapter",
                    {"lora_name": "mine", "lora_path": adapters["a1"]}, H_LIMITED)
        assert load.status_code == 403
        assert complete(server, "secret").status_code == 200  # the admin's key may
    finally:
        post(server, "/v1/unload_lora_adapter", {"lora_name": "secret"})


def test_the_lora_routes_are_documented_and_pass_schemathesis(server, tmp_path):
    spec = httpx.get(server + "/openapi.json", headers=H_ADMIN, timeout=30).json()
    load = spec["paths"]["/v1/load_lora_adapter"]["post"]
    assert {"200", "400", "401", "403", "404", "409", "413", "503"} <= set(load["responses"])
    assert "text/plain" in load["responses"]["200"]["content"]
    assert spec["components"]["schemas"]["LoadLoRAAdapterRequest"][
        "additionalProperties"] is False
    pytest.importorskip("schemathesis")
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "schemathesis_hooks",
           "PYTHONPATH": str(Path(__file__).parent), "TREADLE_API_KEY": ADMIN}
    result = subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "run", server + "/openapi.json",
         "--checks", "all", "--max-examples", "10", "--seed", "1", "--workers", "1",
         "--include-path-regex", "lora_adapter", "-H", f"Authorization: Bearer {ADMIN}",
         "--request-timeout", "60", "--phases", "examples,coverage,fuzzing",
         "--generation-database", "none", "--suppress-health-check", "all"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert {"tiny", "a0"} <= set(models(server))  # the fuzzing unloaded nothing it should not
