"""The engine loop in a background thread, with one asyncio stream of outputs per request.

Owns the thread that steps the engine (EngineCore through the EngineDriver that the
offline LLM uses too), the command queue into it (add, abort), the delivery of each
request's outputs to the event loop of its caller, the per-request timings behind the
latency metrics, and the engine's limits and controls the server may read or set
(`limits`, `set_tenant_weight`, `record_steps`: the EngineClient of engine/client.py).
Tokenization happens in the caller's worker threads (see server/serving.py), never on
the engine thread or the event loop. While idle the loop
still checks, every 0.1 s, that the workers are alive: a dead worker fails every stream
and turns `is_alive` (and so /health) false. A progress watchdog (engine/watchdog.py) on
its own thread turns `stalled` (and so /ready) on when work is queued and no step has
run for `stall_timeout` seconds: a stuck step or a scheduler that schedules nothing.

Why a thread and not a process: torch releases the GIL inside its kernels, which is
where a step spends its time, so the event loop stays responsive, and a thread avoids
serializing every output across a process boundary. Measured with
treadle/bench/loop_latency.py on the demo model (bf16, 2 cores), 32 long requests in
flight: /health answered in 4.0 ms median, 12 ms p99 (563 probes), against ~100 ms
engine steps. A process becomes worth it once Python-side work per step (output
processing for thousands of streams) competes with the loop.

The engine thread also builds the EngineCore (weights, probes, warm-up), so that every
OpenMP parallel region of the process starts from that one thread. A second thread that
ever ran a parallel region keeps an OpenMP team of its own; libgomp then counts more
threads than cores and stops its workers from spinning between regions, so each of the
few hundred regions of a step pays a wake-up. Measured: a decode step of 4 requests took
29-30 ms when the core was built on the main thread and stepped on this one, against
17-20 ms with everything on one thread.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator

from treadle.config import EngineConfig
from treadle.engine.client import EngineDeadError, EngineFailedError
from treadle.engine.core import EngineCore
from treadle.engine.driver import EngineDriver
from treadle.engine.limits import EngineLimits
from treadle.engine.llm import STRUCTURED_UNSUPPORTED, load_tokenizer
from treadle.engine.output_processor import RequestOutput
from treadle.engine.watchdog import core_watchdog
from treadle.lora import AdapterSpec, LoRARequest
from treadle.metrics import EngineMetrics
from treadle.metrics_vllm import cache_config_labels, lora_adapters
from treadle.request import INTERACTIVE, check_scheduling
from treadle.models.resolve import served_model_name as resolved_name
from treadle.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Stream:
    """A caller's view of one request: where its outputs go, and its timings."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float
    num_prompt_tokens: int
    last_token_time: float | None = None
    num_tokens_seen: int = 0
    priority: int = 0
    tenant: str | None = None


class AsyncEngine:
    """Serves many concurrent requests from one EngineCore stepping in a thread; an
    EngineClient (engine/client.py), as the server uses it."""

    def __init__(self, config: EngineConfig, served_model_name: str | None = None) -> None:
        """Builds the EngineCore on the engine thread (see the module docstring) and
        returns once it is ready; the loop itself starts with `start()`."""
        self.config = config
        self._built = threading.Event()
        self._go = threading.Event()
        self._build_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="treadle-engine", daemon=True)
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            raise self._build_error
        self.limits = EngineLimits.from_core(self.core)
        """What a request must fit (vocabulary, context, KV cache): read-only."""
        self.tokenizer = load_tokenizer(self.core.model_dir)
        self.model_name = served_model_name or resolved_name(config.model.model,
                                                             self.core.model_dir)
        self.driver = EngineDriver(self.core, self.tokenizer)
        self.eos_token_id = self.core.eos_token_id
        self.metrics = EngineMetrics(self.model_name)
        self.metrics.vllm.set_cache_config(**cache_config_labels(config, self.core))
        if self.core.loras is not None:
            self.metrics.vllm.set_max_lora(config.lora.max_loras)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.watchdog = core_watchdog(self.core, config.parallel.stall_timeout,
                                      self.metrics.record_stall,
                                      has_pending=lambda: bool(self._streams))
        """Reports a stall: work queued and no step for stall_timeout (engine/watchdog.py)."""

    # ----- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        """Start stepping (the core is built by the constructor), and watching for stalls."""
        self._go.set()
        self.watchdog.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop (waiting up to `timeout` seconds for it) and the workers."""
        self._stop.set()
        self._go.set()
        self._wake.set()
        self.watchdog.stop()
        self._thread.join(timeout)
        self.core.shutdown()

    def set_tenant_weight(self, tenant: str, weight: float) -> None:
        """The fair policy's weight of a tenant (unlisted tenants weigh 1)."""
        self.core.scheduler.set_tenant_weight(tenant, weight)

    # ----- adapters (the registry is thread-safe: called from any thread) -----------------

    @property
    def lora_enabled(self) -> bool:
        """Whether this engine serves adapters (enable_lora)."""
        return self.core.loras is not None

    def add_lora(self, name: str, path: str) -> AdapterSpec:
        """Register an adapter under a fresh id (LoRAError when it does not fit)."""
        lora = LoRARequest(name, self.core.loras.new_id(), path, self.model_name)
        return self.core.add_lora(lora)

    def check_lora(self, name: str, path: str) -> AdapterSpec:
        """Check an adapter's files against the model without registering it (LoRAError
        when it does not fit; ValueError with LoRA off)."""
        if self.core.loras is None:
            raise ValueError("enable_lora is off: this engine serves no adapters")
        return self.core.loras.inspect(path)

    def remove_lora(self, name: str) -> LoRARequest | None:
        """Forget an adapter (None when there was none of that name)."""
        return self.core.remove_lora(name)

    def get_lora(self, name: str) -> LoRARequest | None:
        """The adapter registered under `name`, or None."""
        return None if self.core.loras is None else self.core.loras.get(name)

    def list_loras(self) -> list[LoRARequest]:
        """Every registered adapter."""
        return self.core.list_loras()

    @property
    def tenant_weights(self) -> dict[str, float]:
        """The tenants' weights as the scheduler has them (a copy)."""
        return dict(self.core.scheduler.tenant_weights)

    def record_steps(self, max_steps: int = 2048, max_finished: int = 1000):
        """A StepRecorder (treadle.engine.timeline) of the recent steps and the request
        timelines, fed by the engine thread from its next step on; read it from any thread."""
        from treadle.engine.timeline import StepRecorder

        recorder = StepRecorder(self.core.scheduler, max_steps, max_finished)
        self._send(("observe", recorder))
        return recorder

    @property
    def model_dir(self) -> Path:
        """The checkpoint folder the core loaded."""
        return self.core.model_dir

    def step_thread_cpus(self) -> set[int] | None:
        """The CPU the engine's thread last ran on (Linux), None where that is unknown."""
        try:
            with open(f"/proc/self/task/{self._thread.native_id}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return {int(fields[36])}  # field 39 of proc(5), "processor"
        except (OSError, ValueError, IndexError, TypeError):
            return None

    @property
    def is_alive(self) -> bool:
        """The loop runs and has not failed (/health)."""
        return self._thread.is_alive() and self.error is None and not self._stop.is_set()

    @property
    def stalled(self) -> str | None:
        """Why the engine is stalled (work queued, no step for stall_timeout), or None
        (GET /ready)."""
        return self.watchdog.stalled

    @property
    def supports_structured_outputs(self) -> bool:
        """Whether the core applies grammar masks (treadle.structured) when sampling."""
        return self.core.supports_structured_outputs

    @property
    def num_in_flight(self) -> int:
        """Requests whose stream has not finished."""
        return len(self._streams)

    # ----- requests (called from the event loop) -----------------------------------------

    async def generate(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                       params: SamplingParams, priority: int = 0,
                       tenant: str | None = None,
                       lora_request: LoRARequest | None = None, band: str = INTERACTIVE,
                       slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Yield the request's up-to-date output after every step that changed it.

        `band`: interactive (default) or batch (the lowest band under every policy: idle
        capacity only, preempted first); `slo_ttft_ms` / `slo_tpot_ms`: its deadlines,
        which the `slo` policy orders by (treadle/request.py). A bad value is a
        ValueError naming it, before anything is queued.

        Leaving the iteration early (the client went away) aborts the request: it is
        gone from the engine, its blocks freed, before the next step.
        """
        if not self.is_alive:
            raise EngineDeadError("the engine loop is not running")
        if params.structured_outputs is not None and not self.supports_structured_outputs:
            raise ValueError(STRUCTURED_UNSUPPORTED)
        check_scheduling(band, slo_ttft_ms, slo_tpot_ms)
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue(), time.monotonic(), len(prompt_token_ids))
        self._streams[request_id] = stream
        self._send(("add", request_id, prompt, prompt_token_ids, params, priority, tenant,
                    stream.arrival, lora_request, band, slo_ttft_ms, slo_tpot_ms))
        finished = False
        try:
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

    def abort(self, request_id: str) -> None:
        """End a request early, between steps."""
        self._send(("abort", request_id))

    async def reset_prefix_cache(self) -> bool:
        """Forget every prefix-cache block no request holds, on the engine thread between
        steps (KV events announce it); whether nothing cached is left."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        self._send(("reset_prefix_cache", loop, done))
        return await done

    def abort_all(self, reason: str) -> None:
        """End every in-flight request with an error (shutdown past its timeout)."""
        self._send(("abort_all", reason))

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    # ----- the engine thread --------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.core = EngineCore(self.config)
        except BaseException as exc:
            self._build_error = exc
            return
        finally:
            self._built.set()
        self._go.wait()
        try:
            while not self._stop.is_set():
                self._drain_commands()
                if not self.core.has_unfinished_requests():
                    self.core.check_health()
                    self._record_idle_gauges()  # the last request may have been aborted
                    self._wake.wait(0.1)
                    self._wake.clear()
                    continue
                self._step()
        except BaseException as exc:  # the loop is dead: fail every stream, loudly
            logger.exception("engine loop failed")
            self.error = exc
            for stream in list(self._streams.values()):
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait,
                                                 EngineFailedError(f"engine loop failed: {exc}"))
            self._streams.clear()

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            kind = command[0]
            if kind == "add":
                self._add(*command[1:])
            elif kind == "abort":
                self._abort(command[1])
            elif kind == "abort_all":
                for request_id in list(self._streams):
                    self._abort(request_id, error=command[1])
            elif kind == "observe":
                self.core.trace.add(command[1])
            elif kind == "reset_prefix_cache":
                _, loop, done = command
                loop.call_soon_threadsafe(done.set_result, self.core.reset_prefix_cache())
            else:
                self._handle(command)

    def _handle(self, command: tuple) -> bool:
        """A command of a subclass (treadle/distributed/pd_engine.py); False: unknown."""
        return False

    def _add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
             params: SamplingParams, priority: int, tenant: str | None, arrival: float,
             lora_request: LoRARequest | None, band: str = INTERACTIVE,
             slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None) -> None:
        stream = self._streams.get(request_id)
        if stream is None:  # aborted before it arrived
            return
        stream.priority, stream.tenant = priority, tenant
        rejected = self.driver.add(request_id, prompt, prompt_token_ids, params, arrival,
                                   priority, tenant, lora_request=lora_request, band=band,
                                   slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms)
        if rejected is not None:
            self._deliver(request_id, rejected)

    def _abort(self, request_id: str, error: str | None = None) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        output = self.driver.abort(request_id, error)
        if output is not None:
            self._deliver(request_id, output)
        else:
            self._streams.pop(request_id, None)

    def _step(self) -> None:
        num_scheduled_before = self.core.scheduler.stats.num_scheduled_requests
        request_outputs = self.driver.step()
        sched = self.core.scheduler
        self.metrics.record_step(
            self.core.stats(), sched.num_running, sched.num_waiting, sched.num_swapped,
            sched.stats.num_scheduled_requests - num_scheduled_before,
            self.config.scheduler.max_num_seqs)
        if self.core.loras is not None:
            self.metrics.vllm.set_lora_adapters(*lora_adapters(sched))
        for output in request_outputs:
            self._deliver(output.request_id, output)

    def _record_idle_gauges(self) -> None:
        """Gauges of an idle engine: no step runs to update them after aborts."""
        sched = self.core.scheduler
        self.metrics.record_gauges(sched.num_running, sched.num_waiting, sched.num_swapped,
                                   sched.kv.usage)

    def _deliver(self, request_id: str, output: RequestOutput) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        now = time.monotonic()
        num_tokens = sum(len(c.token_ids) for c in output.outputs)
        if num_tokens > stream.num_tokens_seen:
            if stream.last_token_time is None:
                self.metrics.record_new_tokens(num_tokens - stream.num_tokens_seen,
                                               ttft=now - stream.arrival)
            else:
                self.metrics.record_new_tokens(num_tokens - stream.num_tokens_seen,
                                               gap=now - stream.last_token_time)
            stream.num_tokens_seen = num_tokens
            stream.last_token_time = now
        if output.finished:
            del self._streams[request_id]
            reason = next((c.finish_reason for c in output.outputs if c.finish_reason),
                          "error" if output.error else "abort")
            metrics = output.metrics
            self.metrics.record_finished(
                reason, stream.num_prompt_tokens, num_tokens, stream.arrival,
                metrics.first_scheduled_time if metrics else None,
                metrics.first_token_time if metrics else None, now)
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, output)
