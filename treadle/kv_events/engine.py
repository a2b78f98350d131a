"""What an engine core attaches when `kv_events_endpoint` is set: a recorder on its KV
cache manager and a publisher, flushed once per step.

`KVEvents.attach(kv, ...)` makes the recorder the sink of the KV manager's prefix cache
(core/kv/events.py) and opens the sockets; `flush()` (after each step, after a reset)
publishes what the step changed as one batch, nothing when it changed nothing; `close()`
sends what is left and closes the sockets. The medium is the platform's (`CPU` for
treadle's host caches, `GPU` on CUDA: WorkerInfo.kv_medium).
"""

from __future__ import annotations

from treadle.config.kv_events import KVEventsConfig
from treadle.kv_events.publisher import ZmqEventPublisher
from treadle.kv_events.recorder import KVEventRecorder


class KVEvents:
    """One engine's KV-event recorder and publisher."""

    def __init__(self, recorder: KVEventRecorder, publisher: ZmqEventPublisher) -> None:
        self.recorder = recorder
        self.publisher = publisher

    @classmethod
    def attach(cls, kv, config: KVEventsConfig, block_size: int, medium: str) -> "KVEvents":
        """Record `kv`'s (a KVCacheManager's) prefix cache and publish as `config` says."""
        if not kv.enable_prefix_caching:
            raise ValueError("kv_events_endpoint needs enable_prefix_caching: without a "
                             "prefix cache there is nothing to announce")
        publisher = ZmqEventPublisher(
            config.kv_events_endpoint, config.kv_events_replay_endpoint,
            config.kv_events_topic, config.kv_events_buffer_steps, config.kv_events_encoding,
            config.kv_events_rank)
        recorder = KVEventRecorder(block_size, medium)
        kv.set_event_sink(recorder)
        return cls(recorder, publisher)

    def flush(self) -> None:
        events = self.recorder.take()
        if events:
            self.publisher.publish(events)

    def close(self) -> None:
        self.flush()
        self.publisher.close()
