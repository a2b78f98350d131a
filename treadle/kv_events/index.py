"""`KVEventIndex`: which prefix-cache blocks each replica holds, from its KV events, and how
long a prompt's cached prefix is on each — what a KV-aware router routes on.

A replica is added with the endpoint its engine publishes on (`kv_events_endpoint`, which
binds there: tcp://*:PORT, an ipc:// path; the index connects) and, better, its replay
endpoint; a thread per replica follows it (subscriber.py: in order, missed batches
replayed, a lost range or a restarted engine resets that replica's view). The view is the
set of block hashes on the replica's cache medium (GPU or CPU); blocks parked in swap
memory (`CPU_SWAP`) are kept apart and never count as a hit, since only the request that
parked them can use them.

`longest_prefix` hashes the prompt's full blocks with treadle's own chain
(core/kv/hashing.py: the same root from the cache salt and adapter the engine uses) and
counts the leading blocks the replica holds, capped as the engine caps a hit (one token
is always left to compute). Reads take no lock: a set's membership test is atomic, a
reset swaps the set whole.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from treadle.core.kv.hashing import hash_block, root_hash
from treadle.kv_events.subscriber import EventSubscriber
from treadle.kv_events.wire import (MEDIUM_CPU_SWAP, AllBlocksCleared,
                                                 BlockRemoved, BlockStored, EventBatch,
                                                 wire_hash)


@dataclass
class _ReplicaView:
    blocks: set[int] = field(default_factory=set)
    """Wire hashes of the blocks in the replica's KV cache."""
    swapped: set[int] = field(default_factory=set)
    """Wire hashes of the blocks parked in its swap memory."""
    block_size: int | None = None
    lora_ids: dict[str, int] = field(default_factory=dict)
    """Adapter name -> the id its engine hashes it with (from BlockStored events)."""
    last_seq: int = -1
    """The last batch applied."""
    subscriber: EventSubscriber | None = None


class KVEventIndex:
    """Block hashes per replica, kept from the replicas' KV events."""

    def __init__(self, block_size: int | None = None, topic: str = "") -> None:
        """`block_size`: the engines' (when None, learned from each replica's events);
        `topic`: the topic prefix to subscribe to (every message: "")."""
        self.block_size = block_size
        self.topic = topic
        self._replicas: dict[str, _ReplicaView] = {}
        self._applied = threading.Condition()

    # ----- replicas -----------------------------------------------------------------------

    def add_replica(self, replica_id: str, endpoint: str,
                    replay_endpoint: str | None = None) -> None:
        """Follow the replica publishing on `endpoint` (and replaying on
        `replay_endpoint`); a replica added again under the same id starts afresh."""
        self.remove_replica(replica_id)
        view = _ReplicaView(block_size=self.block_size)
        self._replicas[replica_id] = view
        view.subscriber = EventSubscriber(
            endpoint, lambda seq, batch: self._apply(view, seq, batch),
            lambda: self._reset(view), replay_endpoint, self.topic,
            name=f"kv-index-{replica_id}")

    def remove_replica(self, replica_id: str) -> None:
        view = self._replicas.pop(replica_id, None)
        if view is not None and view.subscriber is not None:
            view.subscriber.close()

    def close(self) -> None:
        for replica_id in list(self._replicas):
            self.remove_replica(replica_id)

    @property
    def replicas(self) -> list[str]:
        return list(self._replicas)

    def num_blocks(self, replica_id: str) -> int:
        """Blocks the replica's KV cache holds, as its events say."""
        return len(self._replicas[replica_id].blocks)

    def last_seq(self, replica_id: str) -> int:
        """The number of the last batch applied for the replica (-1: none yet)."""
        return self._replicas[replica_id].last_seq

    def wait_for(self, replica_id: str, seq: int, timeout: float = 10.0) -> bool:
        """Wait until batch `seq` of the replica is applied; whether it was in time."""
        view = self._replicas[replica_id]
        with self._applied:
            return self._applied.wait_for(lambda: view.last_seq >= seq, timeout)

    # ----- queries ------------------------------------------------------------------------

    def prefix_hashes(self, token_ids: list[int], block_size: int,
                      cache_salt: str | None = None, lora_id: int | None = None) -> list[int]:
        """The wire hashes of the prompt's blocks an engine could take from its cache:
        the first (len(token_ids) - 1) // block_size full blocks."""
        parent = root_hash(cache_salt, lora_id)
        out = []
        for i in range((len(token_ids) - 1) // block_size if token_ids else 0):
            parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size])
            out.append(wire_hash(parent))
        return out

    def longest_prefix(self, replica_id: str, token_ids: list[int],
                       cache_salt: str | None = None, lora_id: int | None = None,
                       lora_name: str | None = None) -> int:
        """Tokens of `token_ids` the replica's prefix cache would serve, by its events:
        the leading full blocks it holds under the chain from `cache_salt` (treadle's
        tenant: the server's salt) and the adapter (`lora_id`, the engine's int id, or
        `lora_name`, resolved through the replica's events; an adapter it never
        announced matches nothing), at most (len - 1) // block_size blocks, times the
        block size. 0 for a replica not added or whose block size is not known yet."""
        view = self._replicas.get(replica_id)
        if view is None or view.block_size is None:
            return 0
        if lora_name is not None and lora_id is None:
            lora_id = view.lora_ids.get(lora_name)
            if lora_id is None:
                return 0
        blocks = view.blocks
        n = 0
        for h in self.prefix_hashes(token_ids, view.block_size, cache_salt, lora_id):
            if h not in blocks:
                break
            n += 1
        return n * view.block_size

    def match(self, token_ids: list[int], cache_salt: str | None = None,
              lora_id: int | None = None, lora_name: str | None = None) -> dict[str, int]:
        """`longest_prefix` of every replica (the prompt hashed once per block size)."""
        return {r: self.longest_prefix(r, token_ids, cache_salt, lora_id, lora_name)
                for r in self.replicas}

    # ----- the subscribers' thread --------------------------------------------------------

    def _apply(self, view: _ReplicaView, seq: int, batch: EventBatch) -> None:
        for event in batch.events:
            if type(event) is BlockStored:
                target = view.swapped if event.medium == MEDIUM_CPU_SWAP else view.blocks
                target.update(event.block_hashes)
                if view.block_size is None:
                    view.block_size = event.block_size
                if event.lora_name is not None and event.lora_id is not None:
                    view.lora_ids[event.lora_name] = event.lora_id
            elif type(event) is BlockRemoved:
                target = view.swapped if event.medium == MEDIUM_CPU_SWAP else view.blocks
                target.difference_update(event.block_hashes)
            elif type(event) is AllBlocksCleared:
                view.blocks, view.swapped = set(), set()
        with self._applied:
            view.last_seq = seq
            self._applied.notify_all()

    def _reset(self, view: _ReplicaView) -> None:
        view.blocks, view.swapped = set(), set()
