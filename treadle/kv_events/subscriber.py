"""Following one publisher of KV-event batches, in order, with gaps filled by replay.

`EventSubscriber` runs a thread with a SUB socket connected to a publisher's endpoint
(which binds: tcp://*:PORT on the engine, an ipc:// path) and, when given the replay
endpoint, a DEALER socket to its ROUTER. It hands `on_batch(seq, batch)` every batch in
sequence order exactly once:

- with a replay endpoint, it first asks for every batch the publisher still has (it
  catches up on joining), and a first live batch numbered past what it has is preceded
  by a replay from 0, so batches sent before the SUB socket joined (ZMQ's slow joiner)
  are not lost;
- a batch whose number jumps past the next one expected is held, the missing range is
  asked of the replay socket, and the held batches follow once it is filled;
- a range the publisher's buffer no longer has (or a publisher without a replay socket)
  calls `on_reset()` (what the consumer held of this publisher may be stale) and goes
  on from the batches it has;
- a number below the next one expected on a batch newer than the last handed over (its
  timestamp) is a restarted publisher: `on_reset()`, then from its 0 again (a replay
  overlap's duplicates are older, and dropped). Since a restarted publisher's first
  batches may go out before the SUB socket has reconnected, every reconnection (the
  socket's monitor says so) asks the replay socket for all it has, which shows a new
  life by its numbers; without a replay socket a reconnection resets.

The handlers run on the subscriber's thread. Owns the sockets and the ordering, not what
the events mean (index.py).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from treadle.kv_events.wire import END_SEQ, EventBatch, decode_batch, seq_bytes

logger = logging.getLogger(__name__)

_REPLAY_TIMEOUT_MS = 2000


class EventSubscriber:
    """One publisher's batches, in order, on a thread of its own."""

    def __init__(self, endpoint: str, on_batch: Callable[[int, EventBatch], None],
                 on_reset: Callable[[], None], replay_endpoint: str | None = None,
                 topic: str = "", name: str = "kv-events") -> None:
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self._on_batch, self._on_reset = on_batch, on_reset
        self._topic = topic.encode("utf-8")
        self.next_seq: int | None = None
        """The number of the next batch to hand over (None: none seen yet)."""
        self.num_gaps = 0
        """Missing ranges seen (each asked of the replay socket)."""
        self.num_resets = 0
        self.num_live = 0
        """Batches received on the SUB socket (not by replay)."""
        self._held: dict[int, EventBatch] = {}
        self._last_ts = float("-inf")
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"treadle-{name}", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    # ----- the thread ---------------------------------------------------------------------

    def _run(self) -> None:
        import zmq  # the kv-events extra

        ctx = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        replay = None
        try:
            sub.setsockopt(zmq.SUBSCRIBE, self._topic)
            sub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                replay = ctx.socket(zmq.DEALER)
                replay.connect(self.replay_endpoint)
        except zmq.ZMQError as exc:
            self._error = ValueError(f"kv_events: cannot follow {self.endpoint!r}: {exc}")
            sub.close(linger=0)
            self._ready.set()
            return
        self._replay_socket = replay
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED)
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        self._ready.set()
        num_connects = 0
        try:
            if replay is not None:
                self._fill(0, None)  # catch up with what the publisher still has
            while not self._stop.is_set():
                ready = dict(poller.poll(50))
                if monitor in ready:
                    monitor.recv_multipart()
                    num_connects += 1
                    if num_connects > 1:
                        self._resync()
                if sub in ready:
                    frames = sub.recv_multipart()
                    if len(frames) == 3:
                        self.num_live += 1
                        self._receive(int.from_bytes(frames[1], "big"), frames[2])
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)

    def _resync(self) -> None:
        """After a reconnection: all the publisher still has, in order, as if live."""
        got = self._replay_from(0)
        if not got:  # nothing to tell a new life from a blip: start afresh
            self._reset()
            self.next_seq = None
            return
        for seq, batch in sorted(got.items()):
            self._receive_batch(seq, batch)

    def _receive(self, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except Exception:  # noqa: BLE001 - a batch we cannot read is a gap
            logger.warning("kv_events: batch %d from %s could not be decoded", seq,
                           self.endpoint)
            return
        self._receive_batch(seq, batch)

    def _receive_batch(self, seq: int, batch: EventBatch) -> None:
        expected = self.next_seq
        if expected is not None and seq < expected:
            if batch.ts <= self._last_ts:
                return  # a batch handed over already
            self._reset()  # the publisher restarted: its numbers begin again
            self.next_seq = expected = None
        if expected is None:
            if seq > 0 and self._replay_socket is not None:
                self._held[seq] = batch
                self._fill(0, seq)
                return
            self.next_seq = seq
        elif seq > expected:
            self.num_gaps += 1
            self._held[seq] = batch
            self._fill(expected, seq)
            return
        self._deliver(seq, batch)
        self._drain_held()

    def _deliver(self, seq: int, batch: EventBatch) -> None:
        try:
            self._on_batch(seq, batch)
        except Exception:  # noqa: BLE001 - the consumer's failure must not stop the thread
            logger.exception("kv_events: a batch handler failed")
        self.next_seq = seq + 1
        self._last_ts = max(self._last_ts, batch.ts)

    def _drain_held(self) -> None:
        while self.next_seq in self._held:
            seq = self.next_seq
            self._deliver(seq, self._held.pop(seq))

    def _fill(self, start: int, end: int | None) -> None:
        """Batches start..end-1 (end None: all the publisher has) from the replay socket,
        then the held ones in order; a part the publisher no longer has resets what the
        consumer holds."""
        got = {seq: batch for seq, batch in self._replay_from(start).items()
               if end is None or seq < end}
        if end is None:
            if not got:
                return
            end = max(got) + 1
        if self.next_seq is None and 0 in got:
            self.next_seq = 0
        if self.next_seq is None or any(s not in got for s in range(self.next_seq, end)):
            if self.next_seq is not None:
                self._reset()  # a range is lost: what came before it may be stale
            first = min(got, default=end)
            self.next_seq = first
        for seq in sorted(got):
            if seq >= self.next_seq:
                self._deliver(seq, got[seq])
        self._drain_held()
        if self._held and self.next_seq not in self._held:  # still a hole: skip to the next
            self.next_seq = min(self._held)
            self._drain_held()

    def _replay_from(self, start: int) -> dict[int, EventBatch]:
        """Every batch from `start` on that the publisher's buffer has (none without a
        replay socket, or when it does not answer in time)."""
        replay = self._replay_socket
        got: dict[int, EventBatch] = {}
        if replay is None:
            return got
        while replay.poll(0):  # late answers to an earlier request that timed out
            replay.recv_multipart()
        replay.send_multipart((b"", seq_bytes(start)))
        while replay.poll(_REPLAY_TIMEOUT_MS):
            frames = replay.recv_multipart()
            if len(frames) != 3 or frames[1] == END_SEQ:
                break
            seq = int.from_bytes(frames[1], "big")
            if seq >= start:
                got[seq] = decode_batch(frames[2])
        return got

    def _reset(self) -> None:
        self.num_resets += 1
        try:
            self._on_reset()
        except Exception:  # noqa: BLE001
            logger.exception("kv_events: a reset handler failed")
