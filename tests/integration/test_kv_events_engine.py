"""KV events from a real engine (a tiny random model, the offline LLM): decoded by a
subscriber written here from vLLM's documented format, they rebuild exactly the prefix
cache's contents after a run that evicts, including the tenant's salt in extra_keys; the
KVEventIndex fed by the same events predicts the prefix hit the engine then takes; a
reset ends with AllBlocksCleared.
"""

from __future__ import annotations

import time
import uuid

import msgpack
import pytest

from treadle import LLM, SamplingParams

zmq = pytest.importorskip("zmq")

from conftest import make_tiny_checkpoint  # noqa: E402
from treadle.kv_events.index import KVEventIndex  # noqa: E402

BLOCK = 4
END = (-1).to_bytes(8, "big", signed=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("kv-events")
    checkpoint = make_tiny_checkpoint(path / "tiny", "llama")
    endpoint = f"ipc://{path}/pub-{uuid.uuid4().hex[:6]}"
    replay = f"ipc://{path}/replay-{uuid.uuid4().hex[:6]}"
    llm = LLM(checkpoint, dtype="float32", block_size=BLOCK, num_kv_blocks=40,
              kv_events_endpoint=endpoint, kv_events_replay_endpoint=replay,
              kv_events_topic="kv@test@tiny")
    yield llm, endpoint, replay
    llm.engine.shutdown()


def all_batches(replay: str) -> list[tuple[int, list]]:
    """Every batch the publisher's buffer holds, decoded from the documented format:
    [b"", seq] out; [b"", seq, msgpack([ts, events, rank])] back, then seq -1."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(replay)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    out = []
    while dealer.poll(5000):
        _, seq, payload = dealer.recv_multipart()
        if seq == END:
            break
        ts, events, rank = msgpack.unpackb(payload, raw=False)
        assert rank == 0
        out.append((int.from_bytes(seq, "big"), events))
    dealer.close(linger=0)
    return out


def settle(llm) -> int:
    publisher = llm.engine.kv_events.publisher
    deadline = time.monotonic() + 10
    while not (publisher._queue.empty() and publisher._queue.unfinished_tasks == 0):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return publisher.num_sent


def rebuild(batches) -> tuple[set[int], dict[int, dict]]:
    view: set[int] = set()
    first_blocks: dict[int, dict] = {}
    for _, events in batches:
        for event in events:
            kind = event["type"]
            if kind == "AllBlocksCleared":
                view.clear()
            elif kind == "BlockRemoved":
                assert event["medium"] == "CPU"
                view.difference_update(event["block_hashes"])
            else:
                assert kind == "BlockStored" and event["block_size"] == BLOCK
                if event["medium"] != "CPU":
                    continue  # swapped-out blocks: their own medium
                view.update(event["block_hashes"])
                if event["parent_block_hash"] is None:
                    first_blocks[event["block_hashes"][0]] = event
    return view, first_blocks


def cache_contents(llm) -> set[int]:
    return {int.from_bytes(h[-8:], "big") for h in llm.engine.scheduler.kv.pool._cached}


def test_events_rebuild_the_prefix_cache_and_carry_the_tenant(engine):
    llm, _, replay = engine
    shared = list(range(10, 30))
    prompts = [shared + [40 + i, 50 + i, 60 + i] for i in range(6)] + \
        [[100 + 7 * i + j for j in range(22)] for i in range(6)]  # more than 40 blocks
    llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0), use_tqdm=False,
                 tenant=["acme"] * 6 + [None] * 6)
    num_sent = settle(llm)
    batches = all_batches(replay)
    assert [seq for seq, _ in batches] == list(range(num_sent))  # none missing, in order
    assert batches[0][1] == [{"type": "AllBlocksCleared"}]
    view, first_blocks = rebuild(batches)
    assert llm.engine.scheduler.kv.pool.num_evictions > 0
    assert view == cache_contents(llm)
    salts = {tuple(e["extra_keys"][0] or ()) for e in first_blocks.values()}
    assert ("acme",) in salts and () in salts  # a tenant's chain starts from its salt
    acme = next(e for e in first_blocks.values() if e["extra_keys"][0] == ["acme"])
    assert acme["token_ids"][:BLOCK] == shared[:BLOCK]


def test_the_index_predicts_the_engines_prefix_hit(engine):
    llm, endpoint, replay = engine
    index = KVEventIndex()
    try:
        index.add_replica("r0", endpoint, replay)  # catches up by replay
        assert index.wait_for("r0", settle(llm) - 1)
        assert index._replicas["r0"].blocks == cache_contents(llm)
        subscriber = index._replicas["r0"].subscriber
        for i in range(100):  # until its SUB socket hears live (ZMQ's slow joiner)
            llm.generate([[200 + i] * (BLOCK + 1)], SamplingParams(max_tokens=1),
                         use_tqdm=False)
            if subscriber.num_live:
                break
            time.sleep(0.02)
        assert subscriber.num_live
        prompt = list(range(10, 30)) + [77, 78, 79, 80, 81]
        llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False,
                     tenant="acme")
        assert index.wait_for("r0", settle(llm) - 1)
        assert index._replicas["r0"].blocks == cache_contents(llm)
        predicted = index.longest_prefix("r0", prompt + [90], cache_salt="acme")
        assert predicted >= 5 * BLOCK
        assert index.longest_prefix("r0", prompt + [90]) < predicted  # not the tenant's
        out, = llm.generate([prompt + [90]], SamplingParams(max_tokens=1), use_tqdm=False,
                            tenant="acme")
        assert out.num_cached_tokens == predicted
        llm.reset_prefix_cache()
        assert index.wait_for("r0", settle(llm) - 1)
        assert index.num_blocks("r0") == 0
        assert all_batches(replay)[-1][1][-1] == {"type": "AllBlocksCleared"}
    finally:
        index.close()
