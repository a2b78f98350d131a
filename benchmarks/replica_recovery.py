"""A replica killed under load: requests lost, and the time until it serves again.

`python benchmarks/replica_recovery.py [--model demo] [--streams 8] [--kill-after 8]`
starts a local Ray cluster in this process, `treadle serve --replicas 2` joined to it
(`--ray-address`), and keeps `--streams` streaming completions in flight (each one a
prompt of its own and `--max-tokens` tokens, sent again as soon as it ends). After
`--kill-after` seconds it kills replica 0's Ray actor (`ray.kill`, as a node loss or an
out-of-memory kill would) and goes on until `--duration`. It reports every request's
fate — finished, ended by an error after tokens were sent, or ended by an error before
any token (lost: the front end should have sent it again) — and the seconds from the
kill until the front end had replica 0 in routing again (`treadle:replica_healthy`) and
until replica 0 had generated tokens again (`treadle:generation_tokens_total`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import threading
import time

import httpx
import ray
from ray import serve

from treadle.integrations.ray_serve.client import ServeEngineClient
from treadle.measure.launch import launched_server
from treadle.measure.scrape import metric_total


async def one(http: httpx.AsyncClient, base: str, max_tokens: int, rng: random.Random):
    """(start, end, tokens sent, error or None) of one streamed completion."""
    body = {"model": "m", "prompt": [rng.randrange(100, 40000) for _ in range(32)],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    start, tokens, error = time.monotonic(), 0, None
    try:
        async with http.stream("POST", base + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                error = f"HTTP {response.status_code}"
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]["message"]
                elif event["choices"] and event["choices"][0]["text"]:
                    tokens += 1
    except httpx.HTTPError as exc:
        error = type(exc).__name__
    return start, time.monotonic(), tokens, error


def watch(base: str, marks: dict, stop: threading.Event) -> None:
    """When replica 0 is in routing again, and when it generates again, after the kill."""
    while "killed" not in marks and not stop.is_set():
        time.sleep(0.05)
    tokens = metric_total(base, "generation_tokens", 'replica="0"')
    while not stop.is_set() and ("healthy" not in marks or "serving" not in marks):
        healthy = metric_total(base, "replica_healthy", 'replica="0"') == 1
        if "down" not in marks and not healthy:
            marks["down"] = time.monotonic()
        if "down" in marks and healthy and "healthy" not in marks:
            marks["healthy"] = time.monotonic()
        now_tokens = metric_total(base, "generation_tokens", 'replica="0"')
        if "healthy" in marks and now_tokens > 0 and now_tokens != tokens:
            marks["serving"] = time.monotonic()  # a new replica's counter starts at 0
        tokens = now_tokens
        time.sleep(0.1)


async def load(base: str, args, client: ServeEngineClient, marks: dict) -> list:
    rng = random.Random(0)
    results, t0 = [], time.monotonic()

    async def worker(http):
        while time.monotonic() - t0 < args.duration:
            results.append(await one(http, base, args.max_tokens, rng))

    async def killer():
        await asyncio.sleep(args.kill_after)
        actor = client.actor(0)
        marks["killed"] = time.monotonic()
        ray.kill(actor, no_restart=True)

    async with httpx.AsyncClient(timeout=300) as http:
        await asyncio.gather(killer(), *[worker(http) for _ in range(args.streams)])
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python benchmarks/replica_recovery.py")
    parser.add_argument("--model", default="demo")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--kill-after", type=float, default=8.0)
    parser.add_argument("--duration", type=float, default=40.0)
    parser.add_argument("--num-cpus", type=int, default=2)
    args = parser.parse_args(argv)
    ray.init(num_cpus=args.num_cpus, include_dashboard=False)
    serve_args = ["--model", args.model, "--served-model-name", "m", "--replicas", "2",
                  "--num-threads", str(max(1, args.num_cpus // 2)), "--routing",
                  "least-load", "--ray-address", ray.get_runtime_context().gcs_address]
    try:
        with launched_server(serve_args, startup_timeout=600) as (base, _):
            [app] = [a for a in serve.status().applications if a.startswith("treadle-")]
            client = ServeEngineClient(
                {"both": serve.get_deployment_handle("TreadleEngine", app)}, None).connect()
            marks: dict = {}
            stop = threading.Event()
            watcher = threading.Thread(target=watch, args=(base, marks, stop), daemon=True)
            watcher.start()
            results = asyncio.run(load(base, args, client, marks))
            watcher.join(120)
            stop.set()
    finally:
        ray.shutdown()
    killed = marks["killed"]
    hit = [r for r in results if r[0] <= killed <= r[1]]
    summary = {
        "requests": len(results), "finished": sum(r[3] is None for r in results),
        "in_flight_at_kill": len(hit),
        "errored_after_tokens": sum(r[3] is not None and r[2] > 0 for r in results),
        "lost_without_a_token": sum(r[3] is not None and r[2] == 0 for r in results),
        "out_of_routing_s": round(marks["down"] - killed, 2) if "down" in marks else None,
        "back_in_routing_s": round(marks["healthy"] - killed, 2) if "healthy" in marks
        else None,
        "serving_again_s": round(marks["serving"] - killed, 2) if "serving" in marks
        else None,
        "errors": sorted({r[3] for r in results if r[3] is not None}),
    }
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
