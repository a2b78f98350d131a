"""P/D's two engine roles in one process (no Ray): a decode engine too full to land a
prefilled request's KV keeps it waiting, without a running slot, until blocks free up,
and the prefill engine holds at most `max_held` requests' KV (the next prefill waits)."""

from __future__ import annotations

import asyncio

import pytest

from replica_fixtures import tiny_model
from treadle.config import EngineConfig
from treadle.distributed.pd_engine import PDEngine
from treadle.request import RequestStatus
from treadle.sampling_params import SamplingParams

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    model = tiny_model(tmp_path_factory.mktemp("tiny"))
    prefill = PDEngine(EngineConfig.from_options(model=model, dtype="float32",
                                                 num_kv_blocks=64, num_threads=1), max_held=1)
    decode = PDEngine(EngineConfig.from_options(model=model, dtype="float32",
                                                num_kv_blocks=10, num_threads=1))
    prefill.start()
    decode.start()
    yield prefill, decode
    prefill.shutdown()
    decode.shutdown()


async def until(condition, timeout_s: float = 30.0):
    for _ in range(int(timeout_s / 0.005)):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("timed out")


async def collect(stream):
    last = None
    async for out in stream:
        last = out
    return last


def test_full_decode_side_defers_the_landing_and_prefill_holds_bounded(engines):
    prefill, decode = engines
    prompt = [100 + 37 * i % 4000 for i in range(4 * 16 + 5)]  # 4 full blocks + 5 tokens
    params = SamplingParams(max_tokens=6, **GREEDY)

    async def main():
        # the reference: the whole request on the prefill engine, colocated
        want = await collect(prefill.generate("ref", None, prompt, params))
        await prefill.hold_slot()
        prefill.want_hold("p", None, None)
        first = await collect(prefill.generate("p", None, prompt,
                                               SamplingParams(max_tokens=1, **GREEDY)))
        assert "p" in prefill.held and prefill.held["p"].num_blocks == 4
        # one slot: a second prefill must wait until the first's KV is released
        blocked = asyncio.ensure_future(prefill.hold_slot())
        await asyncio.sleep(0.2)
        assert not blocked.done()

        # the decode engine is full: all its 10 blocks held by a long request
        hog = asyncio.ensure_future(collect(decode.generate(
            "hog", None, list(range(200, 340)), SamplingParams(max_tokens=20, **GREEDY))))
        await until(lambda: decode.core.scheduler.num_running == 1)

        async def fetch():
            return prefill.export("p", 0)
        rest = asyncio.ensure_future(collect(decode.generate_prefilled(
            "p", None, prompt, params, 0, None, None, first, fetch)))
        await until(lambda: decode.stats["deferred_landings"] > 0)
        request = decode.core.scheduler.requests["p"]
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KV
        assert not hog.done()
        prefill.release_slot("p")
        await asyncio.wait_for(blocked, 5)  # the held KV is gone: the next prefill may go
        prefill.release_slot("x")
        await hog
        got = await rest
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.num_cached_tokens == 4 * 16
        assert decode.stats["landed_blocks"] == 4

    asyncio.run(asyncio.wait_for(main(), 120))


def test_a_sliding_window_model_is_refused_with_the_reason(tmp_path):
    """P/D moves one block table's KV; a sliding-window model has a second one."""
    from conftest import make_tiny_checkpoint

    model = make_tiny_checkpoint(tmp_path / "mistral", "mistral", sliding_window=16)
    with pytest.raises(ValueError, match="sliding-window layer group"):
        PDEngine(EngineConfig.from_options(model=model, dtype="float32", num_kv_blocks=64,
                                           num_threads=1))
