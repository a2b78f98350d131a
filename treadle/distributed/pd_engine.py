"""P/D on one engine: the prefill side keeps a finished prompt's KV for the decode side;
the decode side admits a prefilled request in WAITING_FOR_REMOTE_KV and lands its KV.

Owns, on top of an AsyncEngine (same thread, same loop), the engine-thread work of
disaggregation (treadle/distributed/kv_transfer.py moves the blocks, through the
executor's collective_rpc, so any executor and tensor-parallel size serves):
- prefill: a request asked to `hold` keeps, when it finishes (its one token sampled), a
  copy of its prompt's full KV blocks, read right after the step (the blocks are cached
  and free then, not yet reused). At most `max_held` requests' KV are held; `hold_slot`
  waits for room, so a decode side that does not take the KV stops new prefills rather
  than dropping it.
- decode: `add_prefilled` enters the request with its first token as its first output,
  in WAITING_FOR_REMOTE_KV (no queue place, no running slot); `land` writes the blocks it
  lacks into its prefix cache and releases the request to the waiting queue, retried
  every loop turn while its blocks do not fit.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future

from treadle.compat import check_disaggregation
from treadle.core.outputs import EngineCoreOutput
from treadle.distributed import kv_transfer
from treadle.distributed.kv_transfer import KVPayload
from treadle.engine.async_engine import AsyncEngine, _Stream
from treadle.engine.output_processor import RequestOutput


class PDEngine(AsyncEngine):
    """An AsyncEngine that can hold prompt KV (prefill role) and land it (decode role),
    on any executor and tensor-parallel size (prefill and decode sides may differ)."""

    def __init__(self, config, served_model_name=None, max_held: int = 16) -> None:
        check_disaggregation(config)
        super().__init__(config, served_model_name)
        try:  # now that the model's KV specs are known (a sliding-window group?)
            check_disaggregation(config, self.core.kv_config.specs)
        except ValueError:
            self.shutdown()
            raise
        self._hold_wanted: dict[str, tuple[str | None, int | None]] = {}
        self.held: dict[str, KVPayload] = {}
        self._held_slots = threading.BoundedSemaphore(max_held)
        self._landings: list[tuple[str, KVPayload, Future]] = []
        self.stats = {"held": 0, "landed_blocks": 0, "skipped_blocks": 0,
                      "deferred_landings": 0}

    # ----- prefill side -----------------------------------------------------------------

    async def hold_slot(self) -> None:
        """Wait for room to hold one more request's KV (decode engines full: back off)."""
        while not self._held_slots.acquire(blocking=False):
            await asyncio.sleep(0.005)

    def release_slot(self, request_id: str) -> None:
        if self.held.pop(request_id, None) is not None or request_id in self._hold_wanted:
            self._hold_wanted.pop(request_id, None)
            self._held_slots.release()

    def want_hold(self, request_id: str, cache_salt: str | None, lora_int_id: int | None):
        self._hold_wanted[request_id] = (cache_salt, lora_int_id)

    def export(self, request_id: str, start: int) -> KVPayload | None:
        """The held KV from block `start` on (the decode side holds the ones before)."""
        payload = self.held.get(request_id)
        if payload is None or not start:
            return payload
        return payload.from_block(start)

    def _deliver(self, request_id: str, output: RequestOutput) -> None:
        if output.finished and request_id in self._hold_wanted and request_id not in self.held:
            salt, lora_id = self._hold_wanted[request_id]
            hashes = kv_transfer.prompt_hashes(output.prompt_token_ids,
                                               self.config.cache.block_size, salt, lora_id)
            payload = kv_transfer.read_blocks(self.core, hashes) if not output.error else None
            if payload is not None:
                self.held[request_id] = payload
                self.stats["held"] += 1
        super()._deliver(request_id, output)

    # ----- decode side ------------------------------------------------------------------

    def call(self, fn, *args) -> Future:
        """Run fn(*args) on the engine thread between steps; its result as a Future."""
        future: Future = Future()
        self._send(("pd_call", fn, args, future))
        return future

    def lookup(self, hashes: list[bytes]) -> Future:
        return self.call(kv_transfer.num_cached_prefix_blocks, self.core, hashes)

    async def generate_prefilled(self, request_id: str, prompt, prompt_token_ids, params,
                                 priority, tenant, lora_request, first: RequestOutput,
                                 fetch_kv, **scheduling):
        """The outputs after the first token (which `first` holds) of a request prefilled
        elsewhere; `fetch_kv()` (awaited once the request is in) brings its KVPayload."""
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue(), time.monotonic(), len(prompt_token_ids))
        stream.num_tokens_seen = 1
        stream.last_token_time = time.monotonic()
        self._streams[request_id] = stream
        added = self.call(self._add_prefilled, request_id, prompt, prompt_token_ids, params,
                          priority, tenant, lora_request, first, stream.arrival, scheduling)
        finished = False
        try:
            rejected = await asyncio.wrap_future(added)
            if rejected is not None:
                finished = True
                yield rejected
                return
            payload = await fetch_kv()
            if payload is not None:
                landing: Future = Future()
                self._send(("pd_land", request_id, payload, landing))
                await asyncio.wrap_future(landing)
            else:  # nothing arrived: it computes its prompt here
                self.call(self.core.scheduler.remote_kv_arrived, request_id)
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._send(("abort", request_id))

    def _add_prefilled(self, request_id, prompt, prompt_token_ids, params, priority, tenant,
                       lora_request, first: RequestOutput, arrival: float,
                       scheduling: dict | None = None):
        """Engine thread: the request with its first token, waiting for its KV
        (`scheduling`: band, slo_ttft_ms, slo_tpot_ms)."""
        processor = self.driver.processor
        processor.add_request(request_id, prompt, prompt_token_ids, params, arrival,
                              priority, tenant, lora_request=lora_request, **(scheduling or {}))
        [request] = processor.engine_requests(request_id)
        request.eos_token_id = self.core.eos_token_id
        error = self.core.admission_error(request)
        if error is not None:
            output = self.driver.abort(request_id, error)
            self._streams.pop(request_id, None)
            return output
        token = first.outputs[0].token_ids[0]
        processor.process([EngineCoreOutput(request.request_id, [token])])
        request.append_output_token(token)
        self.core.scheduler.add_remote_kv_request(request)
        return None

    def _drain_commands(self) -> None:
        super()._drain_commands()
        pending, self._landings = self._landings, []
        for request_id, payload, future in pending:
            self._land(request_id, payload, future)

    def _land(self, request_id: str, payload: KVPayload, future: Future) -> None:
        if request_id not in self.core.scheduler.waiting_for_kv:  # aborted meanwhile
            future.set_result(False)
            return
        before = kv_transfer.num_cached_prefix_blocks(self.core, payload.hashes)
        try:
            landed = kv_transfer.land_blocks(self.core, payload)
        except ValueError as exc:  # this payload cannot land here: that request fails
            future.set_exception(exc)
            return
        if not landed:
            self.stats["deferred_landings"] += 1
            self._landings.append((request_id, payload, future))  # decode full: later
            return
        self.stats["landed_blocks"] += max(0, len(payload.hashes) - max(before, payload.start))
        self.stats["skipped_blocks"] += payload.start
        self.core.scheduler.remote_kv_arrived(request_id)
        future.set_result(True)

    def _handle(self, command: tuple) -> bool:
        kind = command[0]
        if kind == "pd_call":
            _, fn, args, future = command
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                future.set_exception(exc)
            return True
        if kind == "pd_land":
            self._land(command[1], command[2], command[3])
            return True
        return False
