"""The ZMQ publisher of KV-event batches: a PUB socket, sequence numbers, a replay buffer.

`publish(events)` (the engine thread) queues a batch and returns; a thread of its own
stamps it with the next sequence number, encodes it (wire.py), sends the three frames
`[topic, seq, payload]` on the PUB socket and keeps `(seq, payload)` in a buffer of the
last `buffer_steps` batches, which the ROUTER socket (when a replay endpoint is given)
serves to a subscriber that asks from a sequence number on. Numbers are given in the
order batches are sent, so they have no gap; a subscriber that sees one jumped missed
batches (its socket's high-water mark, a late start) and asks for them again.

The endpoint rule is vLLM's: an address with `*` or `::`, or an ipc:// or inproc:// one,
binds; any other connects (to a subscriber that binds). The replay socket always binds.
The first batch (seq 0) is an `AllBlocksCleared`: a subscriber that followed an earlier
life of this engine forgets what it held.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

from treadle.kv_events.wire import (END_SEQ, AllBlocksCleared, EventBatch,
                                                 encode_batch, seq_bytes)

logger = logging.getLogger(__name__)

_STOP = object()


def binds(endpoint: str) -> bool:
    """Whether the PUB socket binds this endpoint (else it connects), as vLLM decides."""
    return ("*" in endpoint or "::" in endpoint or endpoint.startswith("ipc://")
            or endpoint.startswith("inproc://"))


class ZmqEventPublisher:
    """PUB (+ ROUTER for replay) on a thread of its own."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = 10_000, encoding: str = "map",
                 data_parallel_rank: int = 0, hwm: int = 100_000,
                 max_queue_size: int = 100_000) -> None:
        import zmq  # the kv-events extra

        self._zmq = zmq
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._replay = None
        try:
            if binds(endpoint):
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(f"kv_events: cannot open {endpoint!r} / {replay_endpoint!r}: "
                             f"{exc}") from exc
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self._topic = topic.encode("utf-8")
        self._encoding = encoding
        self._rank = data_parallel_rank
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        self.num_sent = 0
        self._thread = threading.Thread(target=self._run, name="treadle-kv-events",
                                        daemon=True)
        self._thread.start()
        self.publish([AllBlocksCleared()])

    def publish(self, events: list) -> None:
        """Queue one batch (a step's events) to be numbered and sent."""
        if events:
            self._queue.put(EventBatch(time.time(), events, self._rank))

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued, then stop the thread and close the sockets."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=100)
        if self._replay is not None:
            self._replay.close(linger=0)

    # ----- the thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.02)
            except queue.Empty:
                continue
            if batch is _STOP:
                return
            try:
                self._send(batch)
            except Exception:  # noqa: BLE001 - one bad batch must not stop the events
                logger.exception("kv_events: a batch could not be sent")
            finally:
                self._queue.task_done()

    def _send(self, batch: EventBatch) -> None:
        payload = encode_batch(batch, self._encoding)
        seq = self._next_seq
        self._pub.send_multipart((self._topic, seq_bytes(seq), payload))
        self._buffer.append((seq, payload))
        self._next_seq = seq + 1
        self.num_sent += 1

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("kv_events: a replay request of %d frames ignored", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq_bytes(seq), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))
