"""KV events on the wire: the publisher's frames, sequence numbers and replay, read by a
subscriber written here from vLLM's documented format (not from treadle's decoder, not
from vLLM): three frames [topic, seq as 8 bytes big-endian, msgpack batch]; a batch
[ts, events, data_parallel_rank]; each event a tagged map {"type": ..., fields in vLLM's
declaration order} or, in the array encoding, [tag, fields in that order]; the replay
ROUTER answers [b"", start] with [b"", seq, payload] per buffered batch and ends with
seq -1 and an empty payload. Then treadle's own subscriber and KVEventIndex on the same
publisher: replay of a missed range, a lost range, a restarted publisher.
"""

from __future__ import annotations

import time
import uuid

import msgpack
import pytest

zmq = pytest.importorskip("zmq")

from treadle.core.kv.hashing import hash_block, root_hash  # noqa: E402
from treadle.kv_events.index import KVEventIndex  # noqa: E402
from treadle.kv_events.publisher import ZmqEventPublisher  # noqa: E402
from treadle.kv_events.wire import (AllBlocksCleared, BlockRemoved,  # noqa: E402
                                                 BlockStored, wire_hash)

STORED_FIELDS = ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                 "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
                 "kv_cache_spec_sliding_window"]
"""vLLM's BlockStored fields, in its declaration order."""


def read_message(frames: list[bytes]) -> tuple[bytes, int, list]:
    """A message as vLLM documents it: (topic, seq, [ts, events, rank])."""
    topic, seq, payload = frames
    assert len(seq) == 8
    batch = msgpack.unpackb(payload, raw=False)
    assert isinstance(batch, list) and len(batch) == 3
    assert isinstance(batch[0], float) and isinstance(batch[1], list)
    return topic, int.from_bytes(seq, "big"), batch


def ipc(tmp_path, name: str) -> str:
    return f"ipc://{tmp_path}/{name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def sub_and_pub(tmp_path):
    """A SUB socket bound on 127.0.0.1 and a publisher connecting to it (vLLM's rule: a
    tcp address without * connects), with a replay socket; waits until the SUB hears."""
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    replay = ipc(tmp_path, "replay")
    pub = ZmqEventPublisher(f"tcp://127.0.0.1:{port}", replay, topic="kv@pod@tiny",
                            buffer_steps=5)
    for _ in range(200):  # what is sent before the subscription reaches the PUB is lost
        pub.publish([AllBlocksCleared()])
        if sub.poll(50):
            break
    while sub.poll(200):
        sub.recv_multipart()
    yield sub, pub, replay
    pub.close()
    sub.close(linger=0)


def ask_replay(endpoint: str, start: int) -> list[tuple[int, bytes]]:
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    got = []
    while dealer.poll(5000):
        empty, seq, payload = dealer.recv_multipart()
        assert empty == b""
        if seq == (-1).to_bytes(8, "big", signed=True):
            assert payload == b""
            break
        got.append((int.from_bytes(seq, "big"), payload))
    dealer.close(linger=0)
    return got


def stored(n: int, base: int = 0) -> BlockStored:
    return BlockStored([base + i for i in range(n)], None, list(range(4 * n)), 4, None, "CPU",
                       None, [("tenant",)] + [None] * (n - 1), 0, "full_attention")


def test_frames_sequence_numbers_and_replay_in_vllm_format(sub_and_pub):
    sub, pub, replay = sub_and_pub
    base = pub.num_sent  # the publisher's AllBlocksCleared and the fixture's probes
    for i in range(8):
        pub.publish([stored(2, 10 * i), BlockRemoved([10 * i], "CPU", 0)])
    pub.publish([AllBlocksCleared()])
    # Live messages on the SUB socket: the topic, and numbers one apart, none missing.
    seqs, batches = [], []
    while len(seqs) < 9 and sub.poll(5000):
        topic, seq, batch = read_message(sub.recv_multipart())
        assert topic == b"kv@pod@tiny"
        seqs.append(seq)
        batches.append(batch)
    assert seqs == list(range(base, base + 9))
    assert batches[-1][1] == [{"type": "AllBlocksCleared"}]
    ts, events, rank = batches[-2]
    assert rank == 0 and abs(ts - time.time()) < 60
    first, removed = events
    assert list(first) == ["type", *STORED_FIELDS[:-1]]  # declaration order; None default out
    assert first["type"] == "BlockStored" and first["block_hashes"] == [70, 71]
    assert first["parent_block_hash"] is None and first["token_ids"] == list(range(8))
    assert first["medium"] == "CPU" and first["extra_keys"] == [["tenant"], None]
    assert first["group_idx"] == 0 and first["kv_cache_spec_kind"] == "full_attention"
    assert removed == {"type": "BlockRemoved", "block_hashes": [70], "medium": "CPU",
                       "group_idx": 0}
    # The replay socket: from a number on, what the bounded buffer (5 batches) still has,
    # the same bytes as were published.
    last = base + 8
    replayed = ask_replay(replay, 0)
    assert [seq for seq, _ in replayed] == list(range(last - 4, last + 1))
    assert msgpack.unpackb(replayed[-2][1], raw=False) == batches[-2]
    assert [seq for seq, _ in ask_replay(replay, last - 1)] == [last - 1, last]
    assert ask_replay(replay, last + 1) == []


def test_array_encoding_is_vllms_positional_order(tmp_path):
    endpoint, replay = ipc(tmp_path, "pub"), ipc(tmp_path, "replay")
    pub = ZmqEventPublisher(endpoint, replay, encoding="array")
    try:
        event = stored(1)
        event.lora_id, event.lora_name = 3, "ad"
        pub.publish([event, BlockRemoved([5], "GPU")])
        deadline = time.monotonic() + 10
        while pub.num_sent < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        (_, payload), = ask_replay(replay, 1)
        _, (store, remove), _ = msgpack.unpackb(payload, raw=False)
        assert store == ["BlockStored", [0], None, [0, 1, 2, 3], 4, 3, "CPU", "ad",
                         [["tenant"]]]
        assert remove == ["BlockRemoved", [5], "GPU"]
    finally:
        pub.close()


def wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_index_catches_up_by_replay_and_answers_prefixes(tmp_path):
    """The index joins after batches were sent: the replay gives them; a gap in the live
    stream is filled the same way; longest_prefix hashes with treadle's chain."""
    endpoint, replay = ipc(tmp_path, "pub"), ipc(tmp_path, "replay")
    pub = ZmqEventPublisher(endpoint, replay, buffer_steps=100)
    index = KVEventIndex()
    try:
        tokens = list(range(100, 117))  # 4 full blocks of 4, and one token
        parent, hashes = root_hash("tenant"), []
        for i in range(4):
            parent = hash_block(parent, tokens[4 * i:4 * i + 4])
            hashes.append(wire_hash(parent))
        pub.publish([BlockStored(hashes[:2], None, tokens[:8], 4, None, "CPU", None,
                                 [("tenant",), None], 0)])
        assert wait_until(lambda: pub.num_sent == 2)
        index.add_replica("r0", endpoint, replay)  # after seq 0 and 1 were sent
        assert index.wait_for("r0", 1)
        assert index.longest_prefix("r0", tokens, cache_salt="tenant") == 8
        assert index.longest_prefix("r0", tokens) == 0  # another tenant's chain
        # A gap: a batch is numbered and buffered but lost on the way (dropped at the
        # source): the next one arrives first, the index asks for the missing one and
        # applies both in order.
        joined(pub, index, "r0")
        base = settled(pub)
        gaps = index._replicas["r0"].subscriber.num_gaps
        pub._send = _skip_once(pub._send)  # the next batch is numbered, buffered, not sent
        pub.publish([BlockStored(hashes[2:3], hashes[1], tokens[8:12], 4, None, "CPU",
                                 None, [None], 0)])
        pub.publish([BlockStored(hashes[3:4], hashes[2], tokens[12:16], 4, None, "CPU",
                                 None, [None], 0)])
        assert index.wait_for("r0", base + 1)
        assert index.longest_prefix("r0", tokens, cache_salt="tenant") == 16
        assert index.longest_prefix("r0", tokens[:16], cache_salt="tenant") == 12  # 1 left
        assert index._replicas["r0"].subscriber.num_gaps == gaps + 1
        pub.publish([BlockRemoved(hashes[1:2], "CPU", 0)])
        assert index.wait_for("r0", base + 2)
        assert index.longest_prefix("r0", tokens, cache_salt="tenant") == 4
    finally:
        index.close()
        pub.close()


def _skip_once(send):
    """The publisher's _send that numbers and buffers the next batch without sending it
    on the PUB socket (a message lost on the way)."""
    state = {"skipped": False}

    def wrapped(batch):
        if state["skipped"]:
            return send(batch)
        state["skipped"] = True
        publisher = send.__self__
        real = publisher._pub.send_multipart
        publisher._pub.send_multipart = lambda frames: None
        try:
            send(batch)
        finally:
            publisher._pub.send_multipart = real
    return wrapped


def test_a_range_lost_from_the_buffer_resets_the_view_and_a_restart_too(tmp_path):
    endpoint, replay = ipc(tmp_path, "pub"), ipc(tmp_path, "replay")
    pub = ZmqEventPublisher(endpoint, replay, buffer_steps=2)
    index = KVEventIndex(block_size=4)
    try:
        index.add_replica("r0", endpoint, replay)
        joined(pub, index, "r0")
        base = settled(pub)
        subscriber = index._replicas["r0"].subscriber
        resets = subscriber.num_resets
        pub.publish([stored(1, 1)])
        assert index.wait_for("r0", base) and index.num_blocks("r0") == 1
        pub._send = _skip_many(pub._send, 3)  # 2, 3, 4 lost; the buffer keeps the last 2
        for i in range(3):
            pub.publish([stored(1, 10 + i)])
        pub.publish([stored(1, 20)])
        assert index.wait_for("r0", base + 4)
        assert subscriber.num_resets == resets + 1  # base + 1 was gone: the view was reset
        view = index._replicas["r0"].blocks
        assert view == {12, 20}  # batch 4 (replayed) and 5: what came before is forgotten
        pub.close()
        pub = ZmqEventPublisher(endpoint, replay, buffer_steps=100)  # the engine restarts
        pub.publish([stored(1, 30)])  # may go before the SUB socket has reconnected:

        def heard() -> bool:  # the next batches show the numbers began again, and the
            time.sleep(0.1)  # replay brings the new life's batches from 0
            pub.publish([BlockRemoved([999], "CPU", 0)])
            return index._replicas["r0"].blocks == {30}
        assert wait_until(heard)
        assert subscriber.num_resets >= resets + 2
    finally:
        index.close()
        pub.close()


def joined(pub, index: KVEventIndex, replica_id: str) -> None:
    """Publish no-ops until the index's SUB socket hears one live (what is sent before
    its subscription reaches the publisher is lost: ZMQ's slow joiner)."""
    subscriber = index._replicas[replica_id].subscriber

    def heard() -> bool:
        pub.publish([BlockRemoved([999], "CPU", 0)])
        time.sleep(0.02)
        return subscriber.num_live > 0
    assert wait_until(heard)
    settled(pub)
    assert index.wait_for(replica_id, pub.num_sent - 1)


def settled(pub) -> int:
    """Wait until the publisher has sent all it was given; the next batch's number."""
    assert wait_until(lambda: pub._queue.unfinished_tasks == 0 and pub._queue.empty())
    time.sleep(0.05)
    return pub.num_sent


def _skip_many(send, count: int):
    state = {"left": count}
    publisher = send.__self__

    def wrapped(batch):
        if state["left"] == 0:
            return send(batch)
        state["left"] -= 1
        real = publisher._pub.send_multipart
        publisher._pub.send_multipart = lambda frames: None
        try:
            send(batch)
        finally:
            publisher._pub.send_multipart = real
    return wrapped


def test_options_are_checked_and_replicas_get_their_own_ports():
    from treadle.config import EngineConfig
    from treadle.config.kv_events import KVEventsConfig

    config = KVEventsConfig("tcp://*:5557", "tcp://*:5558", "kv@x")
    second = config.for_replica(2)
    assert (second.kv_events_endpoint, second.kv_events_replay_endpoint,
            second.kv_events_rank) == ("tcp://*:5559", "tcp://*:5560", 2)
    assert KVEventsConfig("ipc:///tmp/kv").for_replica(1).kv_events_endpoint == \
        "ipc:///tmp/kv_dp1"
    assert KVEventsConfig().for_replica(3) == KVEventsConfig()  # off stays off
    for bad in (dict(kv_events_endpoint="http://x:1"), dict(kv_events_endpoint="tcp://*"),
                dict(kv_events_replay_endpoint="tcp://*:5558"),
                dict(kv_events_endpoint="tcp://*:1", kv_events_encoding="json"),
                dict(kv_events_endpoint="tcp://*:1", kv_events_buffer_steps=0)):
        with pytest.raises(ValueError):
            KVEventsConfig(**bad)
    with pytest.raises(ValueError, match="enable_prefix_caching off does not support "
                                         "kv_events_endpoint"):
        EngineConfig.from_options(kv_events_endpoint="tcp://*:5557",
                                  enable_prefix_caching=False)
