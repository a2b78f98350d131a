"""vLLM's KV-event wire format: the events, the batch, the three ZMQ frames, both encodings.

What goes on the wire, as vLLM (`vllm/distributed/kv_events.py`) sends it:

- a message of three frames `[topic, seq, payload]`: the topic as UTF-8, the batch's
  sequence number as 8 bytes big-endian (0, 1, 2, ... with no gap), and the batch as
  MessagePack;
- a batch is the array `[ts, events, data_parallel_rank]` (`ts`: seconds since the
  epoch, a float);
- an event is tagged. **map** (vLLM since its switch from arrays to maps, 2026, and
  what current routers read): `{"type": "BlockStored", "block_hashes": ..., ...}` with
  the fields in vLLM's declaration order and those equal to their default left out, as
  msgspec's `omit_defaults` does. **array** (vLLM before it, for routers that predate
  the switch): `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name, extra_keys]`, trailing defaults left out;
- the replay socket (ROUTER) takes `[b"", start_seq]` (8 bytes big-endian) and answers
  `[b"", seq, payload]` for every buffered batch from `start_seq` on, then
  `[b"", END_SEQ, b""]` with END_SEQ = -1 as 8 signed bytes.

A block hash on the wire is an unsigned 64-bit int: the last 8 bytes, big-endian, of
treadle's 16-byte chained BLAKE2b (core/kv/hashing.py), as vLLM turns its own hashes into
ints. Ints because every consumer decodes them (llm-d's Go indexer and Dynamo's Rust
router as uint64, SGLang's router), where raw bytes are read by some only; llm-d keys
its index by hashes it recomputes from `token_ids` and uses ours only to match
`BlockRemoved`, so any stable id works there. 64 bits: two of a replica's blocks collide
with probability about n^2 / 2^65 (n = 10^6 cached blocks: 3e-8).

Owns only the format (encode for the publisher, decode for treadle's own index); the
tests decode with a reader they write themselves from this description.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import msgpack

MEDIUM_GPU = "GPU"
"""Blocks in the KV cache on a GPU."""
MEDIUM_CPU = "CPU"
"""Blocks in the KV cache in host memory (treadle's CPU platform)."""
MEDIUM_CPU_SWAP = "CPU_SWAP"
"""Blocks of a preempted request parked in swap memory: they serve that request when it
is swapped back in, never another request's prefix hit (a router should weigh them 0)."""

ENCODINGS = ("map", "array")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay socket's end-of-replay sequence number."""

KIND_FULL_ATTENTION = "full_attention"


def wire_hash(block_hash: bytes) -> int:
    """A 16-byte prefix hash as the uint64 the wire carries (the last 8 bytes, big-endian)."""
    return int.from_bytes(block_hash[-8:], "big")


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


@dataclass(slots=True)
class BlockStored:
    """Blocks that entered the prefix cache: one chain of consecutive full blocks of one
    request (`parent_block_hash`: the block before the first, None at the chain's root)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    """The tokens of all the blocks, block_size each, in order."""
    block_size: int
    lora_id: int | None
    """The adapter's int id (deprecated by vLLM in favour of lora_name; kept as it does)."""
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple | None] | None = None
    """One entry per block: what besides its tokens went into its hash — (lora_name,) on
    every block of an adapter's request, and the request's cache salt (treadle: its
    tenant) on the chain's first block — or None."""
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


@dataclass(slots=True)
class BlockRemoved:
    """Blocks that left the prefix cache (evicted, overwritten, reset)."""

    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


@dataclass(slots=True)
class AllBlocksCleared:
    """Nothing is cached any more."""


EVENT_TYPES = {cls.__name__: cls for cls in (BlockStored, BlockRemoved, AllBlocksCleared)}
_ARRAY_FIELDS = {"BlockStored": 8, "BlockRemoved": 2, "AllBlocksCleared": 0}
"""How many of each event's fields the array encoding carries: the fields vLLM sent
positionally before its switch to maps (group_idx and the spec fields came with maps)."""


@dataclass
class EventBatch:
    ts: float
    events: list = field(default_factory=list)
    data_parallel_rank: int | None = None


def _event_map(event) -> dict[str, Any]:
    out: dict[str, Any] = {"type": type(event).__name__}
    for f in dataclasses.fields(event):
        value = getattr(event, f.name)
        if f.default is dataclasses.MISSING or value != f.default:
            out[f.name] = value
    return out


def _event_array(event) -> list:
    fields = dataclasses.fields(event)[:_ARRAY_FIELDS[type(event).__name__]]
    values = [getattr(event, f.name) for f in fields]
    n = len(values)
    while n and fields[n - 1].default is not dataclasses.MISSING \
            and values[n - 1] == fields[n - 1].default:
        n -= 1  # msgspec's omit_defaults on an array: trailing defaults only
    return [type(event).__name__, *values[:n]]


def encode_batch(batch: EventBatch, encoding: str = "map") -> bytes:
    """The batch's MessagePack payload, its events as tagged maps or tagged arrays."""
    encode = _event_map if encoding == "map" else _event_array
    return msgpack.packb([batch.ts, [encode(e) for e in batch.events],
                          batch.data_parallel_rank], use_bin_type=True)


def _decode_event(raw) -> Any:
    if isinstance(raw, dict):
        cls = EVENT_TYPES[raw["type"]]
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in names})
    tag, *values = raw
    cls = EVENT_TYPES[tag]
    fields = dataclasses.fields(cls)
    return cls(**{f.name: v for f, v in zip(fields, values)})


def decode_batch(payload: bytes) -> EventBatch:
    """A payload of either encoding (and of vLLM itself) back into events; unknown fields
    of newer senders are ignored, missing trailing ones take their defaults."""
    raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    ts, events = raw[0], raw[1]
    rank = raw[2] if len(raw) > 2 else None
    return EventBatch(ts, [_decode_event(e) for e in events], rank)
