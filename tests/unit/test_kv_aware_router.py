"""The prefix router on KV events (router/kv_aware.py): a replica's match is what its
events say it holds (a real KVEventIndex, fed events directly), or the prompts routed
there in the last seconds; tenants and adapters salt both; the prefix tree stays the
router when the replicas publish no events (integrations/ray_serve/request_router.py)."""

from __future__ import annotations

import pytest

from treadle.kv_events.index import KVEventIndex, _ReplicaView
from treadle.kv_events.wire import BlockStored, EventBatch
from treadle.router.kv_aware import KVEventRouter
from treadle.router.routers import PrefixAwareRouter, PrefixRouterOptions, ReplicaLoad

B = 4


def loads(*depths):
    return [ReplicaLoad(i, True, d, 0, 0.0) for i, d in enumerate(depths)]


def prompt(prefix: int, n_blocks: int, tail: int) -> list[int]:
    return [prefix] * (n_blocks * B) + [1000 + tail] * B + [7]


def index_holding(replica: str, tokens: list[int], salt: str | None = None,
                  lora: tuple[str, int] | None = None) -> KVEventIndex:
    """A KVEventIndex whose replica `replica` announced the prompt's full blocks."""
    index = KVEventIndex(B)
    view = index._replicas[replica] = _ReplicaView(block_size=B)
    index._replicas.setdefault("0" if replica != "0" else "1", _ReplicaView(block_size=B))
    lora_id = None if lora is None else lora[1]
    hashes = index.prefix_hashes(tokens, B, salt, lora_id)
    index._apply(view, 0, EventBatch(0.0, [BlockStored(
        hashes, None, tokens[:len(hashes) * B], B, lora_id, None,
        None if lora is None else lora[0])]))
    return index


def router(index, **kw) -> KVEventRouter:
    return KVEventRouter(index, PrefixRouterOptions(chunk_size=B, min_match_tokens=B), **kw)


def test_routes_to_the_replica_whose_events_hold_the_prefix():
    held = prompt(1, 3, 0)
    r = router(index_holding("1", held))
    d = r.route(prompt(1, 3, 9), None, loads(0, 0), 0.0)  # never routed here: events only
    assert (d.replica, d.reason, d.matched_tokens) == (1, "prefix", 3 * B)
    # the prefix tree alone, never having sent it anywhere, balances to replica 0
    tree = PrefixAwareRouter(PrefixRouterOptions(chunk_size=B, min_match_tokens=B))
    assert tree.route(prompt(1, 3, 9), None, loads(0, 0), 0.0).reason == "balance"


def test_tenant_and_adapter_salt_the_event_match():
    r = router(index_holding("1", prompt(1, 3, 0), salt="acme", lora=("sql", 3)))
    assert r.route(prompt(1, 3, 9), "acme", loads(0, 0), 0.0, lora_name="sql").replica == 1
    r = router(index_holding("1", prompt(1, 3, 0), salt="acme", lora=("sql", 3)))
    assert r.route(prompt(1, 3, 9), "other", loads(0, 0), 0.0, lora_name="sql").reason \
        == "balance"
    r = router(index_holding("1", prompt(1, 3, 0), salt="acme", lora=("sql", 3)))
    assert r.route(prompt(1, 3, 9), "acme", loads(0, 0), 0.0).reason == "balance"


def test_recent_routes_count_until_the_events_come_then_age_out():
    r = router(KVEventIndex(B), pending_ttl_s=5.0)
    assert r.route(prompt(2, 3, 0), None, loads(0, 0), 0.0).replica == 0
    d = r.route(prompt(2, 3, 1), None, loads(1, 0), 1.0)  # no events yet: the recent route
    assert (d.replica, d.reason) == (0, "prefix")
    d = r.route(prompt(2, 3, 2), None, loads(1, 0), 20.0)  # aged out, no event confirmed it
    assert (d.replica, d.reason) == (1, "balance")


def test_reachable_endpoint_names_the_replicas_node():
    pytest.importorskip("ray")
    from treadle.integrations.ray_serve.deployment import reachable_endpoint

    assert reachable_endpoint("tcp://*:5557", "10.0.0.2") == "tcp://10.0.0.2:5557"
    assert reachable_endpoint("ipc:///tmp/kv_dp1", "10.0.0.2") == "ipc:///tmp/kv_dp1"
    assert reachable_endpoint("tcp://h:5557", "10.0.0.2") is None  # the engine connects out
    assert reachable_endpoint("inproc://kv", "10.0.0.2") is None
    assert reachable_endpoint(None, "x") is None
