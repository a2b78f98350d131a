"""The pieces of treadle on Ray Serve (treadle/integrations/ray_serve) that decide without a
cluster: when the fleet counts as dead (`ServeEngineClient.error`, --replica-max-restarts),
which requests P/D carries and when a prefilled request ends with its first token, and a
replica taking the front end's adapter registry (`EngineReplica.sync_loras`: the front
end's ids kept, removed adapters dropped, an older registry ignored)."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")

from treadle.engine.client import EngineDeadError  # noqa: E402
from treadle.engine.output_processor import CompletionOutput, RequestOutput  # noqa: E402
from treadle.integrations.ray_serve.client import (ServeEngineClient,  # noqa: E402
                                                   ended_with_first, pd_applies)
from treadle.integrations.ray_serve.replica import EngineReplica  # noqa: E402
from treadle.lora import LoRARequest  # noqa: E402
from treadle.router.routers import ReplicaLoad  # noqa: E402
from treadle.sampling_params import SamplingParams  # noqa: E402


class FakeRouter:
    def __init__(self, healthy: dict[int, bool], deaths: dict[int, int]) -> None:
        self.healthy, self.deaths = healthy, deaths

    def replica_views(self):
        return [ReplicaLoad(i, True) for i, up in self.healthy.items() if up]


def client_with(routers: dict, seen: set[int], max_restarts) -> ServeEngineClient:
    client = ServeEngineClient({}, None, max_restarts=max_restarts)
    client.routers, client._seen = routers, seen
    return client


def test_the_fleet_is_dead_once_every_replica_died_past_its_restarts_and_none_serves():
    # one replica still serving: alive, whatever the deaths
    assert client_with({"both": FakeRouter({1: True}, {0: 9, 1: 9})}, {0, 1}, 3).error is None
    # none serving, but replica 1 has restarts left: Ray Serve is bringing it back
    assert client_with({"both": FakeRouter({}, {0: 4, 1: 3})}, {0, 1}, 3).error is None
    dead = client_with({"both": FakeRouter({}, {0: 4, 1: 4})}, {0, 1}, 3)
    assert isinstance(dead.error, EngineDeadError) and not dead.is_alive
    assert "past its restarts" in str(dead.error)
    # P/D: the prefill pool still serves
    pd = {"prefill": FakeRouter({0: True}, {}), "decode": FakeRouter({}, {1: 5})}
    assert client_with(pd, {0, 1}, 3).error is None
    # no bound (build_openai_app's default): never
    assert client_with({"both": FakeRouter({}, {0: 99})}, {0}, None).error is None


def output(finished: bool, reason: str | None, error: str | None = None) -> RequestOutput:
    return RequestOutput("r", None, [1, 2], [CompletionOutput(0, "x", [7], reason)],
                         finished, error=error)


def test_what_pd_carries_and_when_the_first_token_is_the_last():
    assert pd_applies(SamplingParams(max_tokens=4))
    for params in (SamplingParams(n=2), SamplingParams(logprobs=1),
                   SamplingParams(prompt_logprobs=1)):
        assert not pd_applies(params)
    many = SamplingParams(max_tokens=8)
    assert not ended_with_first(output(True, "length"), many)  # only the prefill's one token
    assert ended_with_first(output(True, "stop"), many)
    assert ended_with_first(output(True, "length"), SamplingParams(max_tokens=1))
    assert ended_with_first(output(True, "error", error="boom"), many)


class FakeEngine:
    def __init__(self) -> None:
        self.loras: dict[str, LoRARequest] = {}
        self.core = self

    def add_lora(self, lora: LoRARequest) -> None:
        self.loras[lora.lora_name] = lora

    def remove_lora(self, name: str) -> None:
        self.loras.pop(name)

    def list_loras(self) -> list[LoRARequest]:
        return list(self.loras.values())


def test_a_replica_takes_the_front_ends_adapters_with_their_ids():
    replica = EngineReplica.__new__(EngineReplica)
    replica.engine, replica._loras_version = FakeEngine(), 0
    a, b = LoRARequest("a", 3, "/a"), LoRARequest("b", 5, "/b")
    replica.sync_loras((2, [a, b]))
    assert replica.engine.loras == {"a": a, "b": b}
    replica.sync_loras((1, [a]))  # older than what it has: ignored
    assert set(replica.engine.loras) == {"a", "b"}
    moved = LoRARequest("a", 6, "/a2")  # unloaded and loaded again elsewhere
    replica.sync_loras((4, [moved]))
    assert replica.engine.loras == {"a": moved}
    replica.sync_loras(None)
    assert replica.engine.loras == {"a": moved}
