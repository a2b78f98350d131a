"""KV events from the KV cache manager's hook (core/kv/events.py) and the recorder
(kv_events/recorder.py), without sockets or a model.

A hypothesis state machine drives a KVCacheManager as the scheduler does — requests of
two tenants admitted with prefix hits, decoding, preempted by swap or recompute, resumed,
finished, the prefix cache reset — under a pool small enough that blocks are evicted all
the time. After every rule the events recorded so far, applied in order to an empty view,
must give exactly the prefix cache's contents (BlockStored adds, BlockRemoved removes,
AllBlocksCleared empties), each BlockStored's tokens and parent must hash (treadle's
chain from the salt its extra_keys carry) to the hashes it announces, and the CPU_SWAP
view must hold only chains of requests that are swapped out right now.
"""

from __future__ import annotations

from hypothesis import settings, strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from treadle.core.kv.hashing import hash_block, root_hash
from treadle.core.kv.manager import KVCacheManager
from treadle.kv_events.recorder import KVEventRecorder
from treadle.kv_events.wire import (MEDIUM_CPU, MEDIUM_CPU_SWAP,
                                                 AllBlocksCleared, BlockRemoved, BlockStored,
                                                 wire_hash)
from treadle.lora import LoRARequest
from treadle.request import Request
from treadle.sampling_params import SamplingParams

BLOCK = 4
NUM_BLOCKS = 20
NUM_SWAP = 12
PREFIXES = [[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24, 25]]
TENANTS = [None, "tenant-a", "tenant-b"]


class Replay:
    """A subscriber's view, built from the events alone."""

    def __init__(self) -> None:
        self.views = {MEDIUM_CPU: set(), MEDIUM_CPU_SWAP: set()}
        self.full_by_wire: dict[int, bytes] = {}
        """Wire hash -> the 16-byte hash it came from (for checking the chains)."""

    def apply(self, event, known: dict[int, bytes]) -> None:
        if isinstance(event, AllBlocksCleared):
            self.views[MEDIUM_CPU].clear()
            return
        view = self.views[event.medium]
        if isinstance(event, BlockRemoved):
            assert event.group_idx == 0
            for h in event.block_hashes:
                assert h in view, "a block removed that was never stored"
            view.difference_update(event.block_hashes)
            return
        assert isinstance(event, BlockStored)
        assert event.block_size == BLOCK and event.kv_cache_spec_kind == "full_attention"
        assert len(event.token_ids) == BLOCK * len(event.block_hashes)
        assert len(event.extra_keys) == len(event.block_hashes)
        if event.parent_block_hash is None:
            keys = list(event.extra_keys[0] or ())  # (lora_name?, salt?) on block 0
            if event.lora_name is not None:
                assert keys.pop(0) == event.lora_name
            salt = keys[0] if keys else None
            parent = root_hash(salt, event.lora_id)
        else:
            parent = known[event.parent_block_hash]
        for i, h in enumerate(event.block_hashes):
            parent = hash_block(parent, event.token_ids[i * BLOCK:(i + 1) * BLOCK])
            assert wire_hash(parent) == h, "tokens, parent or salt do not give the hash"
            known[h] = parent
            if i > 0 or event.parent_block_hash is not None:
                lora_keys = (event.lora_name,) if event.lora_name else None
                assert event.extra_keys[i] == lora_keys  # the salt rides on block 0 only
        assert not view.intersection(event.block_hashes), "a block stored twice"
        view.update(event.block_hashes)


class KVEventsMachine(RuleBasedStateMachine):
    running = Bundle("running")
    parked = Bundle("parked")

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK, True, NUM_SWAP)
        self.recorder = KVEventRecorder(BLOCK, MEDIUM_CPU)
        self.kv.set_event_sink(self.recorder)
        self.replay = Replay()
        self.known: dict[int, bytes] = {}
        self.live: dict[str, Request] = {}
        self.swapped: set[str] = set()
        self.count = 0

    def _admit(self, r: Request, num_tokens: int) -> bool:
        hits, num_hit = self.kv.get_computed_blocks(r)
        if not self.kv.allocate_slots(r, num_tokens - num_hit, hits):
            return False
        r.num_computed_tokens = num_tokens
        self.kv.cache_full_blocks(r)
        return True

    @rule(target=running, prefix=st.sampled_from(range(len(PREFIXES))),
          tenant=st.sampled_from(TENANTS), adapter=st.booleans(),
          tail=st.lists(st.integers(3, 30), max_size=7))
    def add(self, prefix, tenant, adapter, tail):
        self.count += 1
        lora = LoRARequest("ad", 7, "/nowhere") if adapter else None
        r = Request(f"r{self.count}", PREFIXES[prefix] + tail,
                    SamplingParams(max_tokens=1000, ignore_eos=True), cache_salt=tenant,
                    tenant=tenant, lora_request=lora)
        if not self._admit(r, r.num_tokens):
            return None
        r.append_output_token(40 + r.num_tokens % 7)
        self.live[r.request_id] = r
        return r

    @rule(r=running, n=st.integers(1, 6))
    def decode(self, r, n):
        if r is None or r.request_id not in self.live or r.request_id in self.swapped:
            return
        if not self.kv.holds(r.request_id):
            return
        for _ in range(n):
            if not self.kv.allocate_slots(r, 1):
                return
            r.num_computed_tokens += 1
            r.append_output_token(40 + r.num_tokens % 7)
            self.kv.cache_full_blocks(r)

    @rule(target=parked, r=consumes(running), swap=st.booleans())
    def preempt(self, r, swap):
        if r is None or r.request_id not in self.live or r.request_id in self.swapped:
            return None
        if not self.kv.holds(r.request_id):
            return r
        if swap and self.kv.can_swap_out(r):
            self.kv.swap_out(r)
            self.swapped.add(r.request_id)
        else:
            self.kv.free(r)
            r.num_computed_tokens = 0
        return r

    @rule(target=running, r=consumes(parked))
    def resume(self, r):
        if r is None or r.request_id not in self.live:
            return None
        if r.request_id in self.swapped:
            if self.kv.swap_in(r) is not None:
                self.swapped.discard(r.request_id)
                self.kv.cache_full_blocks(r)
            return r
        self._admit(r, r.num_tokens - 1)
        return r

    @rule(r=consumes(running))
    def finish(self, r):
        if r is None or r.request_id not in self.live:
            return
        if r.request_id in self.swapped:
            self.kv.free_swapped(r)
            self.swapped.discard(r.request_id)
        else:
            self.kv.free(r)
        self.kv.forget(r)
        del self.live[r.request_id]

    @rule()
    def reset(self):
        self.kv.reset_prefix_cache()

    @invariant()
    def events_give_the_prefix_cache(self):
        for event in self.recorder.take():
            self.replay.apply(event, self.known)
        cached = {wire_hash(h) for h in self.kv.pool._cached}
        assert self.replay.views[MEDIUM_CPU] == cached

    @invariant()
    def swap_events_give_the_swapped_chains(self):
        chains = set()
        for rid in self.swapped:
            r = self.live[rid]
            parent = root_hash(r.cache_salt, r.lora_int_id)
            for i in range(r.num_computed_tokens // BLOCK):
                parent = hash_block(parent, r.all_token_ids[i * BLOCK:(i + 1) * BLOCK])
                chains.add(wire_hash(parent))
        assert self.replay.views[MEDIUM_CPU_SWAP] <= chains

    def teardown(self):
        for r in list(self.live.values()):
            self.finish(r)
        self.events_give_the_prefix_cache()
        assert not self.replay.views[MEDIUM_CPU_SWAP]


KVEventsMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=40,
                                             deadline=None)
test_kv_events_state_machine = KVEventsMachine.TestCase


def test_a_reset_that_empties_the_cache_ends_with_all_blocks_cleared():
    kv = KVCacheManager(8, BLOCK, True)
    recorder = KVEventRecorder(BLOCK, MEDIUM_CPU)
    kv.set_event_sink(recorder)
    r = Request("a", list(range(3, 14)), SamplingParams(max_tokens=4), cache_salt="t")
    hits, _ = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens, hits)
    r.num_computed_tokens = r.num_tokens
    kv.cache_full_blocks(r)
    stored = recorder.take()
    assert [type(e) for e in stored] == [BlockStored]
    assert stored[0].extra_keys == [("t",), None]  # the tenant's salt on the first block
    kv.reset_prefix_cache()  # held blocks keep their hashes: nothing is announced
    assert recorder.take() == []
    kv.free(r)
    kv.reset_prefix_cache()
    removed, cleared = recorder.take()
    assert isinstance(removed, BlockRemoved) and sorted(removed.block_hashes) == sorted(
        stored[0].block_hashes)
    assert isinstance(cleared, AllBlocksCleared)


def test_without_a_sink_the_manager_records_nothing_and_behaves_the_same():
    """The hook is inert when off: the same workload caches the same blocks."""
    def run(with_sink: bool):
        kv = KVCacheManager(6, BLOCK, True)
        if with_sink:
            kv.set_event_sink(KVEventRecorder(BLOCK, MEDIUM_CPU))
        for i in range(5):
            r = Request(f"r{i}", [3 + i] * 9, SamplingParams(max_tokens=2))
            hits, n = kv.get_computed_blocks(r)
            assert kv.allocate_slots(r, r.num_tokens - n, hits)
            r.num_computed_tokens = r.num_tokens
            kv.cache_full_blocks(r)
            kv.free(r)
        return sorted(kv.pool._cached), kv.pool.num_evictions

    assert run(False) == run(True)
    assert run(False)[1] > 0  # evictions happened (the hook's removal path ran)
