"""The engine replica: one AsyncEngine inside one Ray Serve replica (deployment.py).

Owns what a front end calls on a replica: `info` (its limits, model, tokenizer folder),
`generate` (an async generator of the request's RequestOutputs), `abort`,
`routing_stats` and `check_health` (Ray Serve's: the router's view; raises once the
engine died or while it is stalled, and Ray Serve replaces the replica), `metrics_text`
(its Prometheus exposition), the adapters (`sync_loras`: the front end's registry, with
its ids, applied when newer than this replica's, so a replaced replica gets them back on
its first call) and tenant weights, and the KV export/import of prefill/decode
disaggregation (treadle/distributed/pd_engine.py). The engine's thread count is the
replica's declared CPUs, so replicas on one node do not oversubscribe its cores. It
imports no Ray.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os

from treadle.engine.gc_freeze import freeze_startup_heap
from treadle.config import EngineConfig
from treadle.core.kv.hashing import prefix_salt
from treadle.engine.async_engine import AsyncEngine
from treadle.lora import LoRARequest
from treadle.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineReplica:
    """An AsyncEngine serving one replica's requests."""

    def __init__(self, config: EngineConfig, served_model_name: str | None,
                 index: int, role: str = "both", max_held: int = 16) -> None:
        self.index, self.role = index, role
        # Each replica publishes its KV events on its own ports, with its index as rank.
        config = dataclasses.replace(config, kv_events=config.kv_events.for_replica(index))
        if role == "both":
            self.engine = AsyncEngine(config, served_model_name)
        else:  # P/D: KV holding (prefill) and landing (decode) on the engine thread
            from treadle.distributed.pd_engine import PDEngine

            self.engine = PDEngine(config, served_model_name, max_held)
        self.engine.start()
        freeze_startup_heap(f"replica {index}")  # the replica's process serves this engine only
        self.transfers: list[dict] = []
        """Decode role: per request, blocks skipped / sent, bytes, seconds (the last 10000)."""
        if role == "decode":
            self._transfer_metrics = _TransferMetrics(self.engine.metrics.registry,
                                                      self.engine.model_name)
        self._loras_version = 0

    def info(self) -> dict:
        engine = self.engine
        return {"index": self.index, "role": self.role,
                "limits": engine.limits, "model_name": engine.model_name,
                "eos_token_id": engine.eos_token_id, "model_dir": str(engine.core.model_dir),
                "supports_structured_outputs": engine.supports_structured_outputs,
                "lora_enabled": engine.lora_enabled, "pid": os.getpid(),
                "num_threads": engine.config.model.num_threads, "config": engine.config}

    async def generate(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                       params: SamplingParams, priority: int = 0, tenant: str | None = None,
                       lora_request: LoRARequest | None = None, **scheduling):
        """The request's outputs; the prompt's ids only in the first one (the front end
        has them: a long prompt is not pickled again at every step). `scheduling`: band,
        slo_ttft_ms, slo_tpot_ms (AsyncEngine.generate's)."""
        first = True
        async for output in self.engine.generate(request_id, prompt, prompt_token_ids,
                                                 params, priority, tenant, lora_request,
                                                 **scheduling):
            yield output if first else dataclasses.replace(output, prompt_token_ids=None)
            first = False

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    # ----- P/D (treadle/distributed/pd_engine.py) --------------------------------------------

    async def prefill(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                      params: SamplingParams, priority: int = 0, tenant: str | None = None,
                      lora_request: LoRARequest | None = None, **scheduling):
        """Prefill role: the prompt and its first token here (the request's own sampling
        parameters, one token); its prompt KV held for `export_kv` until `release`. Waits
        while `max_held` requests' KV are already held (decode engines full)."""
        engine = self.engine
        await engine.hold_slot()
        engine.want_hold(request_id, prefix_salt(tenant, params.cache_salt),
                         None if lora_request is None else lora_request.lora_int_id)
        one = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        last = None
        try:
            async for output in engine.generate(request_id, prompt, prompt_token_ids, one,
                                                priority, tenant, lora_request, **scheduling):
                last = output
        except BaseException:
            engine.release_slot(request_id)
            raise
        if request_id not in engine.held:
            engine.release_slot(request_id)
        return last, request_id in engine.held

    def export_kv(self, request_id: str, start: int):
        """Prefill role: the held KV from block `start` on (None when nothing is held);
        released here: the caller has it now."""
        payload = self.engine.export(request_id, start)
        self.engine.release_slot(request_id)
        return payload

    def release(self, request_id: str) -> None:
        self.engine.release_slot(request_id)

    async def generate_prefilled(self, request_id: str, prompt: str | None,
                                 prompt_token_ids: list[int], params: SamplingParams,
                                 priority: int, tenant: str | None,
                                 lora_request: LoRARequest | None, first, export,
                                 **scheduling):
        """Decode role: the outputs after the first token of a request prefilled
        elsewhere; `await export(request_id, start)` brings the prefill replica's KV from
        block `start` on (its `export_kv`: a Ray Serve call pinned to that replica). The
        request waits here in WAITING_FOR_REMOTE_KV while the blocks this engine lacks
        come over. `scheduling`: band and deadlines."""
        import time

        engine = self.engine
        record: dict = {}

        async def fetch_kv():
            hashes = _prompt_hashes(engine, prompt_token_ids,
                                    prefix_salt(tenant, params.cache_salt), lora_request)
            start = await asyncio.wrap_future(engine.lookup(hashes))
            t0 = time.perf_counter()
            payload = await export(request_id, start)
            record.update(total_blocks=len(hashes), skipped_blocks=start,
                          sent_blocks=0 if payload is None else payload.num_blocks,
                          bytes=0 if payload is None else payload.nbytes,
                          seconds=time.perf_counter() - t0)
            self.transfers = self.transfers[-9999:] + [record]
            self._transfer_metrics.record(record)
            return payload

        async for output in engine.generate_prefilled(
                request_id, prompt, prompt_token_ids, params, priority, tenant,
                lora_request, first, fetch_kv, **scheduling):
            yield dataclasses.replace(output, prompt_token_ids=None)

    def lookup(self, prompt_token_ids: list[int], tenant: str | None) -> int:
        """Decode role: leading prompt blocks this engine's prefix cache holds (tests)."""
        return self.engine.lookup(_prompt_hashes(self.engine, prompt_token_ids, tenant,
                                                 None)).result(30)

    def pd_stats(self) -> dict:
        return {**getattr(self.engine, "stats", {}),
                "holding": len(getattr(self.engine, "held", {})),
                "transfers": list(self.transfers)}

    def abort_all(self, reason: str) -> None:
        self.engine.abort_all(reason)

    def routing_stats(self) -> dict:
        """Ray Serve's view of this replica for the router: queue, batch, KV usage."""
        sched = self.engine.core.scheduler
        return {"num_waiting": sched.num_waiting, "num_running": sched.num_running,
                "num_in_flight": self.engine.num_in_flight, "kv_usage": sched.kv.usage}

    def check_health(self) -> None:
        """Raises (RuntimeError naming the cause) once the engine loop has died or while
        it is stalled (engine/watchdog.py: work queued, no step for stall_timeout): Ray
        Serve's health check, which replaces the replica."""
        if self.engine.error is not None:
            raise RuntimeError(f"replica {self.index}: the engine loop died "
                               f"({self.engine.error!r})")
        stalled = self.engine.stalled
        if stalled is not None:
            raise RuntimeError(f"replica {self.index}: {stalled}")

    def shutdown(self) -> None:
        self.engine.shutdown()

    def metrics_text(self) -> bytes:
        return self.engine.metrics.exposition()

    def set_tenant_weight(self, tenant: str, weight: float) -> None:
        self.engine.set_tenant_weight(tenant, weight)

    def tenant_weights(self) -> dict[str, float]:
        return self.engine.tenant_weights

    def check_lora(self, name: str, path: str):
        return self.engine.check_lora(name, path)

    def sync_loras(self, loras) -> None:
        """Take the front end's adapters, `loras` = (version, [LoRARequest]), when newer
        than the ones this replica has: the missing registered with the front end's ids
        (every replica keys an adapter's prefix-cache blocks alike), the others removed."""
        if loras is None or loras[0] <= self._loras_version:
            return
        wanted = {lora.lora_name: lora for lora in loras[1]}
        for lora in self.engine.list_loras():
            if wanted.get(lora.lora_name) != lora:
                self.engine.remove_lora(lora.lora_name)
        for lora in wanted.values():
            self.engine.core.add_lora(lora)
        self._loras_version = loras[0]

    def list_loras(self) -> list[LoRARequest]:
        return self.engine.list_loras()


def _prompt_hashes(engine, prompt_token_ids, salt, lora_request) -> list[bytes]:
    """The prompt's block hashes under `salt` (the tenant's, with any cache_salt:
    treadle/core/kv/hashing.py prefix_salt), as the engine's prefix cache keys them."""
    from treadle.distributed.kv_transfer import prompt_hashes

    return prompt_hashes(prompt_token_ids, engine.config.cache.block_size, salt,
                         None if lora_request is None else lora_request.lora_int_id)


class _TransferMetrics:
    """A decode replica's KV transfers in its /metrics: seconds per request, bytes,
    blocks sent and blocks it already held."""

    def __init__(self, registry, model_name: str) -> None:
        from prometheus_client import Counter, Histogram

        labels = ["model_name"]
        self.seconds = Histogram(
            "treadle:pd_kv_transfer_seconds", "Decode side: asking for a request's prompt KV "
            "to having it (lookup, export, the object store)", labels, registry=registry,
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0,
                     5.0)).labels(model_name)
        self.bytes = Counter("treadle:pd_kv_transfer_bytes", "KV bytes received", labels,
                             registry=registry).labels(model_name)
        self.sent = Counter("treadle:pd_kv_blocks_sent", "KV blocks received", labels,
                            registry=registry).labels(model_name)
        self.skipped = Counter("treadle:pd_kv_blocks_skipped", "Prompt blocks not sent: "
                               "this replica's prefix cache held them", labels,
                               registry=registry).labels(model_name)

    def record(self, transfer: dict) -> None:
        self.seconds.observe(transfer["seconds"])
        self.bytes.inc(transfer["bytes"])
        self.sent.inc(transfer["sent_blocks"])
        self.skipped.inc(transfer["skipped_blocks"])
