"""How responsive the server's event loop stays while the engine thread runs flat out.

Sends a saturating batch of long streaming requests, then times /health every 50 ms until
they finish. This is the measurement behind running EngineCore in a thread rather than
a process (engine/async_engine.py): if torch's kernels did not release the GIL, the
event loop would stall for whole steps and these latencies would show it.
"""

from __future__ import annotations

import asyncio
import time

from treadle.measure.report import percentiles


async def measure(url: str, model: str, num_requests: int = 32, max_tokens: int = 256,
                  prompt_len: int = 256) -> dict:
    import httpx

    async def long_request(client, i):
        r = await client.post(url + "/v1/completions", json={
            "model": model, "prompt": [3 + (i + k) % 1000 for k in range(prompt_len)],
            "max_tokens": max_tokens, "ignore_eos": True}, timeout=3600)
        return r.status_code

    latencies = []
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=num_requests + 8)) as client:
        load = asyncio.gather(*[long_request(client, i) for i in range(num_requests)])
        await asyncio.sleep(1.0)  # let the engine fill its batch
        while not load.done():
            start = time.perf_counter()
            await client.get(url + "/health", timeout=60)
            latencies.append(time.perf_counter() - start)
            await asyncio.sleep(0.05)
        codes = await load
    return {"num_requests": num_requests, "max_tokens": max_tokens, "num_probes": len(latencies),
            "all_ok": all(c == 200 for c in codes),
            "health_latency_ms": percentiles([x * 1000 for x in latencies])}
