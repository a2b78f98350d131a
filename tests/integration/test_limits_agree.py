"""The server and the engine core agree on limits (issue 49, item 4): a request exactly at
each limit edge (the largest that fits the KV cache and one token more; the model's
context length and one token more) gets the same verdict through both doors, the
offline `LLM.generate` and the HTTP server, under every KV mode: full attention, a
sliding-window model (tiny Gemma 3), int8 and fp8 caches, and H2O eviction. Admitted
means completed with every token asked for; refused means a 400 on HTTP and an error
output offline, with the same message naming the limit and the same field.

The edges are the engine's sizes, not the rule under test: the KV cache's tokens are the
request-level group's blocks x block_size (`EngineCore.num_kv_blocks`), the context is
`max_model_len`. Under H2O a request keeps at most its budget plus one step of KV, so
with a budget that fits the cache the only edge is the context (before the fix the
server refused with a 400 every request past the cache's tokens, which the core
admitted)."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from treadle import LLM, SamplingParams
from treadle.models.demo import write_demo_model
from server_fixtures import TINY_DEMO

BLOCK = 16
COMMON = dict(dtype="float32", attention_backend="torch", block_size=BLOCK,
              max_num_batched_tokens=512, max_num_seqs=8, num_threads=1)
"""Both doors get the same engine options (LLM's default step budget differs from the
server's, so it is given)."""
KV_BOUND = dict(num_kv_blocks=16)
"""256 tokens of KV under a 512-token context: the KV cache is the edge."""
CONTEXT_BOUND = dict(num_kv_blocks=64, max_model_len=128)
"""1024 tokens of KV over a 128-token context: the context is the edge."""
MODES = {
    "full": {},
    "int8": dict(kv_cache_dtype="int8"),
    "fp8": dict(kv_cache_dtype="fp8_e4m3"),
    "sliding": {},
    "h2o": dict(kv_eviction="h2o", kv_budget_tokens=64),
}
MAX_TOKENS = 8
"""Output tokens of every request (the prompt makes up the rest of its size)."""


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from test_gemma3 import make_gemma3

    demo = write_demo_model(tmp_path_factory.mktemp("demo") / "m", seed=5,
                            config_overrides=TINY_DEMO)
    return {"demo": str(demo), "gemma3": make_gemma3(tmp_path_factory.mktemp("gemma3"))}


def prompt(num_tokens: int) -> list[int]:
    rng = random.Random(num_tokens)
    return [rng.randrange(3, 500) for _ in range(num_tokens)]


def offline_verdicts(llm: LLM, sizes: list[int]) -> list:
    """Verdicts through LLM.generate, every size at once."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": prompt(n - MAX_TOKENS)} for n in sizes],
                           params, use_tqdm=False)
    verdicts = []
    for out in outputs:
        if out.error is not None:
            assert out.outputs[0].finish_reason == "error"
            verdicts.append(("refused", out.error))
        else:
            assert out.outputs[0].finish_reason == "length"
            verdicts.append(("completed", len(out.outputs[0].token_ids)))
    return verdicts


def http_verdicts(model: str, options: dict, sizes: list[int]) -> list:
    """Verdicts through the HTTP server (the whole app, in process), one request each."""
    from treadle.config import EngineConfig
    from treadle.server.config import ServerConfig
    from treadle.engine.async_engine import AsyncEngine
    from treadle.server.api import build_app
    from treadle.server.auth import KeyRing

    engine = AsyncEngine(EngineConfig.from_options(model=model, **COMMON, **options), "tiny")
    engine.start()
    try:
        app = build_app(engine, ServerConfig(dashboard=False, request_timelines=0),
                        KeyRing({}))

        async def main():
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                         timeout=120) as client:
                return [await client.post("/v1/completions", json={
                    "model": "tiny", "prompt": prompt(n - MAX_TOKENS),
                    "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
                    for n in sizes]

        verdicts = []
        for r in asyncio.run(main()):
            if r.status_code == 200:
                verdicts.append(("completed", r.json()["usage"]["completion_tokens"]))
            else:
                assert r.status_code == 400, r.text
                error = r.json()["error"]
                assert error["param"] == "max_tokens", error
                verdicts.append(("refused", error["message"]))
        return verdicts
    finally:
        engine.shutdown()


def edge_sizes(llm: LLM, mode: str) -> dict[int, str | None]:
    """Request size (prompt + max_tokens) -> the limit it breaks (None: it fits), from the
    engine's sizes."""
    context = llm.engine.max_model_len
    kv_tokens = llm.engine.num_kv_blocks * BLOCK  # the request-level group's blocks
    if mode == "h2o":  # its budget (64 tokens + one step) fits the 256-token cache
        assert kv_tokens < 300 < context
        return {300: None, context: None, context + 1: "context length"}
    if kv_tokens < context:
        return {kv_tokens: None, kv_tokens + 1: "KV cache"}
    return {context: None, context + 1: "context length"}


CASES = [(mode, "kv") for mode in MODES] + [(mode, "context") for mode in MODES
                                             if mode != "h2o"]


@pytest.mark.parametrize("mode, bound", CASES, ids=[f"{m}-{b}" for m, b in CASES])
def test_both_doors_agree_at_every_limit_edge(models, mode, bound):
    model = models["gemma3" if mode == "sliding" else "demo"]
    options = {**(KV_BOUND if bound == "kv" else CONTEXT_BOUND), **MODES[mode]}
    llm = LLM(model=model, **COMMON, **options)
    expected = edge_sizes(llm, mode)
    assert (bound == "kv") == ("KV cache" in expected.values() or mode == "h2o")
    sizes = sorted(expected)
    offline = offline_verdicts(llm, sizes)
    online = http_verdicts(model, options, sizes)
    assert online == offline  # the same verdict, the same message
    for size, (verdict, detail) in zip(sizes, offline):
        limit = expected[size]
        if limit is None:
            assert (verdict, detail) == ("completed", MAX_TOKENS), (size, detail)
        else:
            assert verdict == "refused" and limit in detail, (size, detail)
            assert detail.startswith("max_tokens: "), detail
