"""Prefill/decode disaggregation on Ray Serve (a local Ray cluster of 2 CPUs, a tiny model;
`start_replicas`, what `treadle serve --prefill-replicas 1 --decode-replicas 1` runs): 1
prefill + 1 decode replica give the greedy float32 outputs of one colocated engine, the
decode side admits each request with the transferred blocks as prefix-cache hits, a
prompt whose prefix the decode side already holds gets only the other blocks sent, and a
decode replica killed mid-stream ends its request with an error and is replaced."""

from __future__ import annotations

import asyncio

import pytest

ray = pytest.importorskip("ray")

from replica_fixtures import OPTIONS, tiny_model  # noqa: E402
from treadle.config import EngineConfig  # noqa: E402
from treadle.distributed.config import ReplicaConfig  # noqa: E402
from treadle.sampling_params import SamplingParams  # noqa: E402

pytestmark = pytest.mark.ray
BLOCK = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def pd(tiny, tmp_path_factory):
    """One prefill and one decode replica, publishing KV events (each on its own ipc
    path): the prefill replicas' router routes on them."""
    from treadle.integrations.ray_serve.launch import start_replicas

    events = f"ipc://{tmp_path_factory.mktemp('kv')}/events"
    ray.init(num_cpus=2, include_dashboard=False)
    replicas = start_replicas(EngineConfig.from_options(model=tiny, kv_events_endpoint=events,
                                                        **OPTIONS),
                              ReplicaConfig(prefill_replicas=1, decode_replicas=1), "tiny")
    yield replicas
    replicas.shutdown()
    ray.shutdown()


def run_all(pd, prompts, params, prefix="r"):
    async def one(i):
        last = None
        async for out in pd.generate(f"{prefix}-{i}", None, prompts[i], params):
            last = out
        return last

    async def main():
        return await asyncio.gather(*[one(i) for i in range(len(prompts))])
    return asyncio.run(main())


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 49000 + 100 for i in range(length)]


def test_pd_greedy_outputs_equal_colocated(tiny, pd):
    from treadle import LLM

    # under a block, exactly one and two blocks (the last token's block is recomputed),
    # and several blocks with a tail
    prompts = [prompt(i, n) for i, n in enumerate((5, BLOCK, 2 * BLOCK, 3 * BLOCK + 7, 70))]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    got = run_all(pd, prompts, params)
    llm = LLM(model=tiny, **OPTIONS)
    want = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in got)
    # the decode side found every full block of the prompt in its prefix cache (its own
    # sequence is the prompt and the first token: the prompt's last block is a hit too)
    assert [o.num_cached_tokens for o in got] == [len(p) // BLOCK * BLOCK for p in prompts]
    # one token, and a request P/D does not carry (logprobs) still answer like one engine
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    assert run_all(pd, prompts[:1], one, "one")[0].outputs[0].token_ids == \
        want[0].outputs[0].token_ids[:1]
    lp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=2)
    assert run_all(pd, prompts[1:2], lp, "lp")[0].outputs[0].token_ids == \
        want[1].outputs[0].token_ids[:4]


def test_transfer_sends_only_the_blocks_the_decode_side_lacks(pd):
    shared = prompt(100, 4 * BLOCK)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    run_all(pd, [shared + prompt(101, 2 * BLOCK + 3)], params, "a")
    first = pd.pd_stats()[0]["transfers"][-1]
    assert (first["total_blocks"], first["skipped_blocks"], first["sent_blocks"]) == (6, 0, 6)
    run_all(pd, [shared + prompt(102, 3 * BLOCK + 1)], params, "b")
    second = pd.pd_stats()[0]["transfers"][-1]
    assert (second["total_blocks"], second["skipped_blocks"], second["sent_blocks"]) == \
        (7, 4, 3)
    assert second["bytes"] == first["bytes"] // 6 * 3
    # nothing is held on the prefill side once the decode side has the KV
    assert pd.call(0, "pd_stats")["held"] >= 2
    assert not pd.call(0, "pd_stats").get("holding")


def test_router_follows_each_replicas_kv_events(pd):
    import time

    from treadle.router.kv_aware import KVEventRouter

    router = pd.routers["prefill"]
    assert isinstance(router.router, KVEventRouter)
    index = router.index  # the prefill replicas' events (the decode ones route least-load)
    assert sorted(index.replicas) == ["0"]
    shared = prompt(300, 3 * BLOCK + 2)
    run_all(pd, [shared], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), "ev")
    deadline = time.monotonic() + 30  # the prefill replica's events reach the index
    while time.monotonic() < deadline and index.longest_prefix("0", shared) == 0:
        time.sleep(0.1)
    assert index.longest_prefix("0", shared) == 3 * BLOCK
    assert index.longest_prefix("0", shared, cache_salt="other") == 0


def test_decode_replica_killed_mid_stream_errors_and_is_replaced(pd):
    import time

    from treadle.engine.async_engine import EngineFailedError

    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)

    async def main():
        seen = 0
        with pytest.raises(EngineFailedError, match="replica 1 died"):
            async for _ in pd.generate("killed", None, prompt(7, 40), params):
                seen += 1
                if seen == 3:  # the first token (prefill side) and two from the decode side
                    ray.kill(pd.actor(1), no_restart=True)
        return seen

    assert asyncio.run(main()) >= 3
    assert not pd.replicas[1].healthy  # out of routing at once
    deadline = time.monotonic() + 120
    while not pd.replicas[1].healthy and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pd.replicas[1].healthy, "Ray Serve did not replace the decode replica"
    assert pd.call(0, "pd_stats")["holding"] == 0  # its KV was released
    short = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    assert len(run_all(pd, [prompt(8, 20)], short, "after")[0].outputs[0].token_ids) == 5
