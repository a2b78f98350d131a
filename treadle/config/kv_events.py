"""The KV-events options: one section of EngineConfig (`--kv-events-*` flags,
TREADLE_KV_EVENTS_* variables), so every door (the server, LLM, replicas) has them.

Owns the fields, their checks, and the per-replica endpoints (`for_replica`: ports offset
by the replica's index, as vLLM offsets them by data-parallel rank). Imports nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

_SCHEMES = ("tcp://", "ipc://", "inproc://")


def _help(text: str) -> dict[str, str]:
    return {"help": text}


def offset_port(endpoint: str | None, offset: int) -> str | None:
    """`tcp://host:port` with the port moved up by `offset`; ipc/inproc get a suffix."""
    if not endpoint or offset == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + offset}"
    return f"{endpoint}_dp{offset}"


@dataclass(frozen=True)
class KVEventsConfig:
    """KV-cache events in vLLM's format, for KV-aware routers (docs/kv_events.md)."""

    kv_events_endpoint: str | None = field(default=None, metadata=_help(
        "Publish every block the prefix cache stores or drops on a ZMQ PUB socket here, in "
        "vLLM's format: tcp://*:5557 binds (as do ipc:// and inproc://), tcp://HOST:PORT "
        "connects to a subscriber that binds; none: no events"))
    kv_events_replay_endpoint: str | None = field(default=None, metadata=_help(
        "ZMQ ROUTER socket (binds) that replays missed batches by sequence number, e.g. "
        "tcp://*:5558"))
    kv_events_topic: str = field(default="", metadata=_help(
        "Topic frame of every message (llm-d reads kv@POD_IP@MODEL)"))
    kv_events_buffer_steps: int = field(default=10_000, metadata=_help(
        "Batches (one per engine step that changed the cache) kept for replay"))
    kv_events_encoding: str = field(default="map", metadata=_help(
        "map: each event a tagged map, as vLLM sends since 2026 and current routers "
        "read; array: tagged arrays in vLLM's older field order, for routers that predate "
        "the switch"))
    kv_events_rank: int = field(default=0, metadata=_help(
        "The batches' data_parallel_rank, and how far the endpoints' ports are moved up "
        "(treadle serve --replicas: each replica's index)"))

    def __post_init__(self) -> None:
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not value.startswith(_SCHEMES):
                raise ValueError(f"{name} must start with tcp://, ipc:// or inproc://, "
                                 f"got {value!r}")
            if value is not None and value.startswith("tcp://") and \
                    not value.rpartition(":")[2].isdigit():
                raise ValueError(f"{name} must end with :PORT, got {value!r}")
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")
        if self.kv_events_buffer_steps < 1:
            raise ValueError(f"kv_events_buffer_steps must be >= 1, "
                             f"got {self.kv_events_buffer_steps}")
        if self.kv_events_encoding not in ("map", "array"):
            raise ValueError(f"kv_events_encoding must be map or array, "
                             f"got {self.kv_events_encoding!r}")
        if self.kv_events_rank < 0:
            raise ValueError(f"kv_events_rank must be >= 0, got {self.kv_events_rank}")

    @property
    def enabled(self) -> bool:
        return self.kv_events_endpoint is not None

    def for_replica(self, index: int) -> "KVEventsConfig":
        """The options of replica `index` of a replica set: its rank, its own ports."""
        if not self.enabled:
            return self
        return dataclasses.replace(
            self, kv_events_rank=index,
            kv_events_endpoint=offset_port(self.kv_events_endpoint, index),
            kv_events_replay_endpoint=offset_port(self.kv_events_replay_endpoint, index))
