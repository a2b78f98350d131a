"""What KV events cost the engine thread: the KV cache manager's work for a stream of
requests (prefix lookup, allocation, registering full blocks, freeing; a pool small
enough that blocks are evicted all the time) with no event sink, with the recorder
attached (core/kv/events.py's hook building vLLM's events), and with the recorder plus
the MessagePack encoding of each step's batch (the publisher thread's work, here on the
same thread: an upper bound). Modes alternate within each repeat; medians and ratios to
`off`.

    python benchmarks/kv_events_hook.py [--requests 2000] [--repeats 7]

`--modes off` runs on a checkout without KV events too (PYTHONPATH=that checkout), for
the cost of the hook's `is None` tests against the code before them.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from treadle.core.kv.manager import KVCacheManager
from treadle.request import Request
from treadle.sampling_params import SamplingParams

BLOCK = 16


def workload(num_requests: int, seed: int = 0) -> list[list[int]]:
    """Prompts of 256-1024 tokens, a third sharing one of 8 system prompts of 512."""
    rng = random.Random(seed)
    systems = [[rng.randrange(50_000) for _ in range(512)] for _ in range(8)]
    prompts = []
    for _ in range(num_requests):
        tail = [rng.randrange(50_000) for _ in range(rng.randrange(256, 1024))]
        prompts.append(rng.choice(systems) + tail[:512] if rng.random() < 0.33 else tail)
    return prompts


def run(prompts: list[list[int]], mode: str) -> float:
    kv = KVCacheManager(2048, BLOCK, True)
    recorder = encode = None
    if mode != "off":
        from treadle.kv_events.recorder import KVEventRecorder
        from treadle.kv_events.wire import EventBatch, encode_batch

        recorder = KVEventRecorder(BLOCK, "CPU")
        kv.set_event_sink(recorder)
        if mode == "on+encode":
            def encode(events):
                encode_batch(EventBatch(0.0, events, 0))
    params = SamplingParams(max_tokens=16)
    live: list[Request] = []
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        r = Request(str(i), prompt, params)
        hits, num_hit = kv.get_computed_blocks(r)
        while not kv.allocate_slots(r, r.num_tokens - num_hit, hits):
            done = live.pop(0)
            kv.free(done)
            kv.forget(done)
        r.num_computed_tokens = r.num_tokens
        kv.cache_full_blocks(r)
        live.append(r)
        if len(live) > 16:
            done = live.pop(0)
            kv.free(done)
            kv.forget(done)
        if recorder is not None:  # one flush per "step"
            events = recorder.take()
            if encode is not None and events:
                encode(events)
    return time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--modes", nargs="+", default=["off", "on", "on+encode"])
    args = parser.parse_args(argv)
    prompts = workload(args.requests)
    times: dict[str, list[float]] = {m: [] for m in args.modes}
    for repeat in range(args.repeats):
        order = args.modes[repeat % len(args.modes):] + args.modes[:repeat % len(args.modes)]
        for mode in order:
            times[mode].append(run(prompts, mode))
    base = statistics.median(times[args.modes[0]])
    tokens = sum(len(p) for p in prompts)
    print(f"{args.requests} requests, {tokens} prompt tokens, {args.repeats} repeats")
    for mode in args.modes:
        median = statistics.median(times[mode])
        per_request = median / args.requests * 1e6
        print(f"{mode:10s} {median * 1e3:8.1f} ms  {per_request:6.1f} us/request  "
              f"x{median / base:.3f}")


if __name__ == "__main__":
    main()
