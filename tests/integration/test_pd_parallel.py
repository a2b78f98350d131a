"""P/D through the executor (no Ray): a request prefilled on one PDEngine and decoded on
another gives one engine's greedy float32 outputs when the workers run in child processes
(`mp`) and split by tensor parallelism (TP 2) on both sides, and when the two sides' splits
differ (TP 1 -> TP 2 and TP 2 -> TP 1: each decode rank takes its KV heads out of the
prefill ranks' parts), with the decode side admitting the landed blocks as prefix hits and
sending only the blocks it lacks; a payload that cannot land fails its request alone;
pipeline parallelism is refused at start, naming it."""

from __future__ import annotations

import asyncio

import pytest

from replica_fixtures import tiny_model
from treadle.config import EngineConfig
from treadle.distributed.kv_transfer import prompt_hashes
from treadle.distributed.pd_engine import PDEngine
from treadle.sampling_params import SamplingParams

GREEDY = dict(temperature=0, ignore_eos=True)
BLOCK = 16
SPLITS = {"uni": dict(distributed_executor_backend="uni"),
          "mp": dict(distributed_executor_backend="mp"),
          "tp2": dict(tensor_parallel_size=2),
          "int8": dict(distributed_executor_backend="uni", kv_cache_dtype="int8")}
"""Each engine's workers: in-process, one child process, two tensor-parallel ranks (and
an int8 KV cache, whose KV no other engine here can take)."""


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """The one-engine reference (uni), a prefill and a decode engine of each split, and an
    int8 prefill engine."""
    model = tiny_model(tmp_path_factory.mktemp("tiny"))
    built = {}
    try:
        for name, options in [("ref", SPLITS["uni"]), ("prefill-int8", SPLITS["int8"])] + [
                (f"{role}-{split}", SPLITS[split]) for split in ("mp", "tp2")
                for role in ("prefill", "decode")]:
            built[name] = PDEngine(EngineConfig.from_options(
                model=model, dtype="float32", num_kv_blocks=64, num_threads=1, **options))
            built[name].start()
        yield built
    finally:
        for engine in built.values():
            engine.shutdown()


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 49000 + 100 for i in range(length)]


async def collect(stream):
    last = None
    async for out in stream:
        last = out
    return last


async def disaggregated(prefill: PDEngine, decode: PDEngine, request_id: str,
                        tokens: list[int], params: SamplingParams):
    """The request prefilled on `prefill` (its first token, its KV held), then decoded on
    `decode` with the blocks it lacks exported and landed: what an EngineReplica does."""
    await prefill.hold_slot()
    prefill.want_hold(request_id, None, None)
    first = await collect(prefill.generate(request_id, None, tokens,
                                           SamplingParams(max_tokens=1, **GREEDY)))
    assert request_id in prefill.held

    async def fetch():
        hashes = prompt_hashes(tokens, BLOCK, None, None)
        start = await asyncio.wrap_future(decode.lookup(hashes))
        payload = prefill.export(request_id, start)
        prefill.release_slot(request_id)
        return payload

    return await collect(decode.generate_prefilled(request_id, None, tokens, params, 0, None,
                                                   None, first, fetch))


@pytest.mark.parametrize("prefill_split, decode_split, seed", [
    ("mp", "mp", 1), ("tp2", "tp2", 2), ("mp", "tp2", 3), ("tp2", "mp", 4)])
def test_prefilled_request_decodes_as_one_engine(engines, prefill_split, decode_split, seed):
    prefill, decode = engines[f"prefill-{prefill_split}"], engines[f"decode-{decode_split}"]
    params = SamplingParams(max_tokens=10, **GREEDY)
    shared = prompt(seed, 2 * BLOCK)
    tokens = [shared + prompt(seed + 100, BLOCK + 5), shared + prompt(seed + 200, 2 * BLOCK)]

    async def main():
        want = [await collect(engines["ref"].generate(f"ref-{seed}-{i}", None, t, params))
                for i, t in enumerate(tokens)]
        before = dict(decode.stats)
        got = [await disaggregated(prefill, decode, f"pd-{seed}-{i}", t, params)
               for i, t in enumerate(tokens)]
        return want, got, {k: decode.stats[k] - before[k] for k in before}

    want, got, stats = asyncio.run(asyncio.wait_for(main(), 240))
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    # every full prompt block was a prefix hit on the decode side: its KV landed there
    assert [g.num_cached_tokens for g in got] == [len(t) // BLOCK * BLOCK for t in tokens]
    # the first request sent all its 3 blocks, the second only the 2 it did not share
    assert (stats["landed_blocks"], stats["skipped_blocks"]) == (3 + 2, 2)
    assert not prefill.held


def test_kv_that_cannot_land_fails_its_request_and_the_engine_goes_on(engines):
    """An int8 KV payload offered to a float32-KV decode engine in child processes: that
    request fails, naming kv_cache_dtype on both sides; the engine serves the next one."""
    decode = engines["decode-mp"]
    params = SamplingParams(max_tokens=4, **GREEDY)
    tokens = prompt(9, 2 * BLOCK + 3)

    async def main():
        with pytest.raises(ValueError, match="kv_cache_dtype int8 .*this engine's is auto"):
            await disaggregated(engines["prefill-int8"], decode, "bad", tokens, params)
        for _ in range(2000):  # the abort reaches the engine thread as a command
            if "bad" not in decode.core.scheduler.requests:
                break
            await asyncio.sleep(0.005)
        assert "bad" not in decode.core.scheduler.requests
        want = await collect(engines["ref"].generate("ref-after", None, tokens, params))
        got = await collect(decode.generate("after", None, tokens, params))
        return want, got

    want, got = asyncio.run(asyncio.wait_for(main(), 120))
    assert decode.is_alive
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.num_cached_tokens == 0  # nothing of the refused payload was cached


def test_pipeline_parallelism_is_refused_at_start(tmp_path):
    from conftest import make_tiny_checkpoint

    model = make_tiny_checkpoint(tmp_path / "llama", "llama")
    with pytest.raises(ValueError, match="pipeline_parallel_size > 1 does not support P/D disaggregation"):
        PDEngine(EngineConfig.from_options(model=model, dtype="float32", num_kv_blocks=64,
                                           num_threads=1, pipeline_parallel_size=2))
