"""The replica router on scripted sequences: prefix hits, imbalance, aging, tenants, deaths."""

from __future__ import annotations

import pytest

from treadle.router.prefix_tree import PrefixTree, chunk_hashes
from treadle.router.routers import (NoReplicaError, PrefixAwareRouter, PrefixRouterOptions,
                                    ReplicaLoad, make_router)

B = 4  # tokens per chunk (block)


def loads(*depths, kv=None, dead=()):
    return [ReplicaLoad(i, i not in dead, d, 0, (kv or {}).get(i, 0.0))
            for i, d in enumerate(depths)]


def prompt(prefix: int, n_prefix_blocks: int, tail: int) -> list[int]:
    """n_prefix_blocks blocks of a shared prefix `prefix`, then a distinct tail."""
    return [prefix] * (n_prefix_blocks * B) + [1000 + tail] * B + [7]


def router(**kw) -> PrefixAwareRouter:
    return PrefixAwareRouter(PrefixRouterOptions(chunk_size=B, min_match_tokens=B, **kw))


def test_chunk_hashes_chain_and_salt():
    a = chunk_hashes(list(range(10)), B, None)
    assert len(a) == 2  # 10 tokens: two full chunks, the partial one left out
    assert chunk_hashes(list(range(8)) + [99], B, None) == a
    assert chunk_hashes([0, 1, 2, 9] + list(range(4, 10)), B, None)[1] != a[1]  # chained
    assert chunk_hashes(list(range(10)), B, "tenant-a") != a


def test_prefix_hits_follow_the_first_placement():
    r = router()
    seq = []
    for i in range(6):  # two prefixes, alternating: each sticks to where it went first
        d = r.route(prompt(1 + i % 2, 3, i), None, loads(0, 0), now=float(i))
        seq.append((d.replica, d.reason, d.matched_tokens))
    assert seq[0] == (0, "balance", 0)
    assert seq[1] == (1, "balance", 0)  # prefix 2 is new: the emptier tree
    assert seq[2:] == [(0, "prefix", 3 * B), (1, "prefix", 3 * B)] * 2


def test_round_robin_ignores_prefixes_and_skips_dead():
    r = make_router("round-robin")
    picks = [r.route(prompt(1, 3, i), None, loads(0, 0, 0), 0.0).replica for i in range(4)]
    assert picks == [0, 1, 2, 0]
    assert [r.route([1], None, loads(0, 0, 0, dead=(2,)), 0.0).replica
            for _ in range(3)] == [1, 0, 1]


def test_least_load_picks_shallowest_queue_then_kv():
    r = make_router("least-load")
    assert r.route([1], None, loads(3, 1, 2), 0.0).replica == 1
    assert r.route([1], None, loads(1, 1, kv={0: 0.5, 1: 0.2}), 0.0).replica == 1


def test_imbalance_overrides_the_prefix():
    r = router(balance_abs=2, balance_rel=1.5)
    assert r.route(prompt(1, 3, 0), None, loads(0, 0), 0.0).replica == 0
    # replica 0 holds the prefix; 2 more requests than replica 1 is within balance_abs
    d = r.route(prompt(1, 3, 1), None, loads(3, 1), 1.0)
    assert (d.replica, d.reason) == (0, "prefix")
    # 3 more and 4x: imbalanced, the prefix is ignored for the least loaded replica
    d = r.route(prompt(1, 3, 2), None, loads(4, 1), 2.0)
    assert (d.replica, d.reason) == (1, "balance")
    # both hold it now: the tie goes to the shallower queue
    assert r.route(prompt(1, 3, 3), None, loads(2, 1), 3.0).replica == 1
    # abs exceeded but not rel (10 vs 7 < 1.5x): the prefix still wins
    assert r.route(prompt(5, 3, 0), None, loads(0, 0), 4.0).replica == 0
    assert r.route(prompt(5, 3, 1), None, loads(10, 7), 5.0).replica == 0


def test_full_kv_overrides_the_prefix():
    r = router(max_kv_usage=0.9)
    r.route(prompt(1, 3, 0), None, loads(0, 0), 0.0)
    assert r.route(prompt(1, 3, 1), None, loads(0, 0, kv={0: 0.95}), 1.0).replica == 1


def test_longest_prefix_wins_and_short_matches_do_not_count():
    r = PrefixAwareRouter(PrefixRouterOptions(chunk_size=B, min_match_tokens=2 * B))
    r.route(prompt(1, 1, 0), None, loads(0, 0), 0.0)  # replica 0: prefix 1, one block
    r.route(prompt(1, 3, 1), None, loads(1, 0), 0.1)  # 1 block matched < min: least loaded
    assert r.tree(1).num_tokens == 4 * B
    d = r.route(prompt(1, 3, 2), None, loads(0, 0), 0.2)
    assert (d.replica, d.matched_tokens) == (1, 3 * B)  # 3 blocks at 1 beat 1 block at 0


def test_entries_age_out():
    r = router(ttl_s=10.0)
    r.route(prompt(1, 3, 0), None, loads(0, 0), 0.0)
    assert r.route(prompt(1, 3, 1), None, loads(0, 1), 9.0).reason == "prefix"  # refreshed
    d = r.route(prompt(1, 3, 2), None, loads(0, 0), 19.5)  # 10.5 s since the last use
    assert (d.reason, d.matched_tokens) == ("balance", 0)


def test_tenants_never_share_a_prefix():
    r = router()
    r.route(prompt(1, 3, 0), "a", loads(0, 0), 0.0)
    d = r.route(prompt(1, 3, 1), "b", loads(1, 0), 1.0)  # same tokens, another tenant
    assert (d.replica, d.reason) == (1, "balance")
    assert r.route(prompt(1, 3, 2), "a", loads(1, 1), 2.0).replica == 0


def test_dead_replica_is_skipped_and_forgotten():
    r = router()
    r.route(prompt(1, 3, 0), None, loads(0, 0), 0.0)
    d = r.route(prompt(1, 3, 1), None, loads(0, 0, dead=(0,)), 1.0)
    assert (d.replica, d.reason) == (1, "balance")
    r.forget(0)
    assert r.tree(0).num_tokens == 0
    with pytest.raises(NoReplicaError):
        r.route([1], None, loads(0, 0, dead=(0, 1)), 2.0)


def test_tree_capacity_evicts_least_recent_leaves_first():
    tree = PrefixTree(B, capacity_tokens=6 * B, ttl_s=100.0)
    old = chunk_hashes(prompt(1, 3, 0), B, None)  # 4 chunks
    new = chunk_hashes(prompt(2, 1, 0), B, None)  # 2 chunks
    tree.insert(old, 0.0)
    tree.insert(new, 1.0)
    assert tree.num_tokens == 6 * B
    tree.insert(chunk_hashes(prompt(3, 1, 0), B, None), 2.0)  # 2 more: 2 of old's leaves go
    assert tree.num_tokens == 6 * B
    assert tree.match(old, 3.0) == 2 * B  # the shared prefix of old survives, its tail went
    assert tree.match(new, 3.0) == 2 * B


def test_bad_options_name_the_field():
    with pytest.raises(ValueError, match="route_balance_rel"):
        PrefixRouterOptions(balance_rel=0.5)
    with pytest.raises(ValueError, match="routing must be one of"):
        make_router("random")


def test_router_imports_neither_ray_nor_torch():
    import subprocess
    import sys

    code = ("import sys, treadle.router.routers, treadle.distributed.config; "
            "bad = [m for m in ('torch', 'ray', 'numpy') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
