"""A hypothesis state machine on the KV cache manager under speculative steps: requests are
admitted (with prefix-cache hits), decode with proposed tokens and slots held ahead for a
draft, roll back what was rejected (`trim`), are preempted by recompute or swap, come
back and finish, in any order. After every rule: no block is referenced by anything but
the tables that hold it, every block a table holds past its computed tokens is its own,
and every hash in the prefix cache is the chain of some request's accepted tokens — a
rejected token never reaches it. At the end every block is free again."""

from __future__ import annotations

from hypothesis import settings, strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, consumes, invariant,
                                 rule)

from treadle.core.kv.hashing import hash_block, root_hash
from treadle.core.kv.manager import KVCacheManager
from treadle.request import Request
from treadle.sampling_params import SamplingParams

BLOCK = 4
NUM_BLOCKS = 24
NUM_SWAP = 16
PREFIXES = [[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24, 25]]


def model_token(index: int) -> int:
    """The token the (fake) model puts at a sequence index: what verification accepts."""
    return 40 + index % 7


class KVRollback(RuleBasedStateMachine):
    running = Bundle("running")
    parked = Bundle("parked")

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK, True, NUM_SWAP)
        self.live: dict[str, Request] = {}
        self.swapped: set[str] = set()
        self.accepted_hashes: set[bytes] = set()
        self.count = 0

    def _remember(self, r: Request) -> None:
        """Hashes of the chains of r's full blocks of computed (accepted) tokens."""
        parent = root_hash(r.cache_salt)
        for i in range(r.num_computed_tokens // BLOCK):
            parent = hash_block(parent, r.all_token_ids[i * BLOCK:(i + 1) * BLOCK])
            self.accepted_hashes.add(parent)

    def _admit(self, r: Request) -> bool:
        hits, num_hit = self.kv.get_computed_blocks(r)
        if not self.kv.allocate_slots(r, r.num_tokens - num_hit, hits):
            return False
        r.num_computed_tokens = r.num_tokens  # the whole prompt (and any output) computed
        r.append_output_token(model_token(r.num_tokens))
        self.kv.cache_full_blocks(r)
        self._remember(r)
        return True

    @rule(target=running, prefix=st.sampled_from(range(len(PREFIXES))),
          tail=st.lists(st.integers(3, 30), max_size=6))
    def add(self, prefix, tail):
        self.count += 1
        r = Request(f"r{self.count}", PREFIXES[prefix] + tail,
                    SamplingParams(max_tokens=1000, ignore_eos=True))
        if not self._admit(r):
            return None
        self.live[r.request_id] = r
        return r

    @rule(r=running, k=st.integers(0, 5), correct=st.integers(0, 5),
          ahead=st.integers(0, 4))
    def speculate(self, r, k, correct, ahead):
        """One decode step with k proposals, the first `correct` of them right, and
        `ahead` slots held past the step for a draft's proposals."""
        if r is None or r.request_id not in self.live or r.request_id in self.swapped:
            return
        if not self.kv.holds(r.request_id):
            return
        if not self.kv.allocate_slots(r, 1 + k):
            return
        self.kv.allocate_slots(r, 1 + k + ahead)  # best effort, as the scheduler does
        start = r.num_tokens  # index of the first proposed token
        accepted = min(correct, k)
        r.num_computed_tokens += 1 + k
        for j in range(accepted):
            r.append_output_token(model_token(start + j))
        r.append_output_token(model_token(start + accepted))  # the model's own
        r.num_computed_tokens -= k - accepted
        self.kv.trim(r)
        self.kv.cache_full_blocks(r)
        self._remember(r)
        assert self.kv.num_held_blocks(r.request_id) == self.kv.num_blocks_for(
            r.num_computed_tokens)

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
            if self.kv.swap_in(r) is None:
                return r
            self.swapped.discard(r.request_id)
            return r
        return r if self._admit_again(r) else r

    def _admit_again(self, r: Request) -> bool:
        hits, num_hit = self.kv.get_computed_blocks(r)
        if not self.kv.allocate_slots(r, r.num_tokens - 1 - num_hit, hits):
            return False
        r.num_computed_tokens = r.num_tokens - 1  # recomputed up to its last token
        self.kv.cache_full_blocks(r)
        self._remember(r)
        return True

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

    @invariant()
    def blocks_are_referenced_only_by_the_tables_that_hold_them(self):
        pool = self.kv.pool
        pool.check_invariants()
        refs = [0] * NUM_BLOCKS
        for rid in self.live:
            if self.kv.holds(rid):
                for block_id in self.kv.block_ids(rid):
                    refs[block_id] += 1
        assert refs == [b.ref_cnt for b in pool.blocks]

    @invariant()
    def blocks_past_the_computed_tokens_are_private_and_unhashed(self):
        owners: dict[int, int] = {}
        for rid in self.live:
            if self.kv.holds(rid):
                for block_id in self.kv.block_ids(rid):
                    owners[block_id] = owners.get(block_id, 0) + 1
        for rid, r in self.live.items():
            if not self.kv.holds(rid):
                continue
            for i, block_id in enumerate(self.kv.block_ids(rid)):
                if (i + 1) * BLOCK > r.num_computed_tokens:
                    block = self.kv.pool.blocks[block_id]
                    assert owners[block_id] == 1, (r, i)
                    assert block.block_hash is None, (r, i)

    @invariant()
    def the_prefix_cache_holds_only_accepted_tokens(self):
        for block_hash in self.kv.pool._cached:
            assert block_hash in self.accepted_hashes

    def teardown(self):
        for r in list(self.live.values()):
            self.finish(r)
        assert self.kv.pool.num_free_blocks == NUM_BLOCKS
        assert self.kv.swap_pool.num_free_blocks == NUM_SWAP
        self.kv.pool.check_invariants()


KVRollback.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                        deadline=None)
test_kv_rollback = KVRollback.TestCase


def test_accepted_hashes_are_not_trivially_all_hashes():
    """The prefix-cache invariant can fail: a block registered while holding a rejected
    token is caught."""
    m = KVRollback()
    r = Request("x", [1, 2, 3], SamplingParams(max_tokens=10, ignore_eos=True))
    assert m.kv.allocate_slots(r, 8)
    r.num_computed_tokens = 3
    m._remember(r)
    r.append_output_token(99)  # a rejected proposal wrongly kept
    r.num_computed_tokens = 4
    m.kv.cache_full_blocks(r)  # registers [1, 2, 3, 99]
    try:
        m.the_prefix_cache_holds_only_accepted_tokens()
    except AssertionError:
        return
    raise AssertionError("the invariant did not catch a rejected token in the cache")
