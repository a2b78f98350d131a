"""An in-memory recorder of recent engine steps and of every request's timeline.

Owns what the dashboard, `GET /v1/requests/{id}` and the OpenTelemetry spans read:

- a ring of the last `max_steps` steps (`StepRecord`: which requests ran with how many
  tokens and of which kind, who was preempted and how, who finished, and the gauges after
  the step: running / waiting / swapped, KV usage, cumulative prefix-cache tokens);
- one `RequestTimeline` per request: arrival, each scheduled chunk with its step
  (consecutive decode steps kept as one run), preemptions with their kind (swap or
  recompute), first token, finish; kept while the request lives and for the last
  `max_finished` finished ones;
- once a second, a snapshot of the cumulative counters (tokens per tenant, prefix-cache
  tokens), so readers can take differences over the last minute.

It is a sink of treadle.engine.step_observers, fed by the same EngineCore calls as the
`--trace` file: the engine thread writes, under one lock held for the few microseconds
of each call; other threads read only through the snapshot methods (copies). Finish
listeners (the OTLP exporter) are called on the engine thread and must only enqueue.
It decides nothing, never blocks on a reader, and imports no torch.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Iterable

from treadle.request import RequestStatus

PREFILL, DECODE = "prefill", "decode"
SWAP, RECOMPUTE = "swap", "recompute"


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One engine step as the recorder keeps it (never changed once made)."""

    seq: int
    """The recorder's own count of steps (a step that only preempted shares its engine
    step number with the next one)."""
    step: int
    t_start: float
    t_end: float
    scheduled: tuple
    """(request_id, num_tokens, kind, tenant) per scheduled request."""
    preempted: tuple
    """(request_id, kind, tenant) per request preempted when the step was scheduled."""
    finished: tuple
    """(request_id, reason) per request that finished in the step."""
    num_prefill_tokens: int
    num_decode_tokens: int
    num_running: int
    num_waiting: int
    num_swapped: int
    kv_usage: float


@dataclass(slots=True)
class Chunk:
    """A stretch of a request's work: one prefill chunk, or a run of consecutive decode
    steps."""

    kind: str
    first_step: int
    last_step: int
    num_steps: int
    num_tokens: int
    t_start: float
    t_end: float


class RequestTimeline:
    """What happened to one request, in engine steps and monotonic seconds."""

    __slots__ = ("request_id", "parent_id", "tenant", "priority", "num_prompt_tokens",
                 "max_tokens", "arrival", "chunks", "preemptions", "first_token",
                 "num_output_tokens", "num_cached_tokens", "finish", "_last_kind")

    def __init__(self, request_id: str, parent_id: str | None, tenant: str | None,
                 priority: int, num_prompt_tokens: int, max_tokens: int,
                 arrival: float) -> None:
        self.request_id, self.parent_id, self.tenant = request_id, parent_id, tenant
        self.priority, self.num_prompt_tokens, self.max_tokens = (
            priority, num_prompt_tokens, max_tokens)
        self.arrival = arrival
        self.chunks: list[Chunk] = []
        self.preemptions: list[tuple[int, float, str]] = []
        """(step, time, kind) per preemption."""
        self.first_token: tuple[int, float] | None = None
        self.num_output_tokens = 0
        self.num_cached_tokens = 0
        self.finish: tuple[int | None, float, str] | None = None
        """(step or None outside a step, time, reason)."""
        self._last_kind: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish is not None

    @property
    def status(self) -> str:
        if self.finish is not None:
            return "finished"
        if not self.chunks and not self.preemptions:
            return "waiting"
        if self.preemptions and (not self.chunks
                                 or self.preemptions[-1][0] > self.chunks[-1].last_step):
            return "swapped" if self.preemptions[-1][2] == SWAP else "preempted"
        return "running"

    @property
    def num_prefill_chunks(self) -> int:
        return sum(1 for c in self.chunks if c.kind == PREFILL)

    @property
    def num_decode_steps(self) -> int:
        return sum(c.num_steps for c in self.chunks if c.kind == DECODE)

    def _add_chunk(self, step: int, num_tokens: int, kind: str, t_start: float,
                   t_end: float) -> None:
        last = self.chunks[-1] if self.chunks else None
        if (kind == DECODE and self._last_kind == DECODE and last is not None
                and last.last_step == step - 1):
            last.last_step = step
            last.num_steps += 1
            last.num_tokens += num_tokens
            last.t_end = t_end
        else:
            self.chunks.append(Chunk(kind, step, step, 1, num_tokens, t_start, t_end))
        self._last_kind = kind

    def to_dict(self, wall_offset: float = 0.0) -> dict:
        """JSON-ready: times in seconds since arrival, `arrival_time` as Unix seconds
        (`wall_offset` = time.time() - time.monotonic())."""
        a = self.arrival

        def since(t: float | None) -> float | None:
            return None if t is None else round(t - a, 6)

        first_scheduled = self.chunks[0] if self.chunks else None
        return {
            "id": self.request_id,
            "parent_id": self.parent_id,
            "tenant": self.tenant,
            "priority": self.priority,
            "status": self.status,
            "finish_reason": self.finish[2] if self.finish else None,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_cached_tokens": self.num_cached_tokens,
            "max_tokens": self.max_tokens,
            "num_output_tokens": self.num_output_tokens,
            "arrival_time": round(a + wall_offset, 6),
            "queue_wait_s": since(first_scheduled.t_start) if first_scheduled else None,
            "first_scheduled_step": first_scheduled.first_step if first_scheduled else None,
            "ttft_s": since(self.first_token[1]) if self.first_token else None,
            "first_token_step": self.first_token[0] if self.first_token else None,
            "e2e_s": since(self.finish[1]) if self.finish else None,
            "finish_step": self.finish[0] if self.finish else None,
            "num_prefill_chunks": self.num_prefill_chunks,
            "num_decode_steps": self.num_decode_steps,
            "num_preemptions": len(self.preemptions),
            "chunks": [{"kind": c.kind, "first_step": c.first_step, "last_step": c.last_step,
                        "num_steps": c.num_steps, "num_tokens": c.num_tokens,
                        "start_s": since(c.t_start), "end_s": since(c.t_end)}
                       for c in self.chunks],
            "preemptions": [{"step": step, "kind": kind, "at_s": since(t)}
                            for step, t, kind in self.preemptions],
        }


@dataclass(frozen=True, slots=True)
class CounterSample:
    """The recorder's cumulative counters at one moment (taken about once a second)."""

    t: float
    tokens_by_tenant: dict
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    num_steps: int


class StepRecorder:
    """Bounded memory of the engine's recent steps and request timelines (see module)."""

    def __init__(self, scheduler, max_steps: int = 2048, max_finished: int = 1000,
                 max_samples: int = 120, clock: Callable[[], float] = time.monotonic) -> None:
        """`scheduler`: read (never changed) for gauges and preemption kinds."""
        if max_steps < 1 or max_finished < 0:
            raise ValueError(f"max_steps must be >= 1 and max_finished >= 0, got "
                             f"{max_steps} and {max_finished}")
        self._scheduler = scheduler
        self._clock = clock
        self.max_finished = max_finished
        self.wall_offset = time.time() - time.monotonic()
        self._lock = threading.Lock()
        self._steps: deque[StepRecord] = deque(maxlen=max_steps)
        self._seq = 0
        self._live: dict[str, RequestTimeline] = {}
        self._finished: OrderedDict[str, RequestTimeline] = OrderedDict()
        self._by_parent: dict[str, list[str]] = {}
        self._pending_kinds: dict[str, str] = {}
        """Preemption kind per request, from schedule time to the step's record."""
        self._tokens_by_tenant: dict[str | None, int] = {}
        self._samples: deque[CounterSample] = deque(maxlen=max_samples)
        self._sample_second: int | None = None
        self._listeners: tuple = ()

    def add_finish_listener(self, listener: Callable[[RequestTimeline], None]) -> None:
        """Call `listener(timeline)` on the engine thread when a request finishes; it
        must return at once (enqueue, never export inline)."""
        self._listeners = (*self._listeners, listener)

    # ----- the engine thread ------------------------------------------------------------

    def record_arrival(self, request) -> None:
        timeline = RequestTimeline(request.request_id, request.parent_id, request.tenant,
                                   request.priority, request.num_prompt_tokens,
                                   request.sampling_params.max_tokens, request.arrival_time)
        with self._lock:
            self._live[request.request_id] = timeline
            if request.parent_id is not None:
                self._by_parent.setdefault(request.parent_id, []).append(request.request_id)

    def record_scheduled(self, step: int, scheduler_output) -> None:
        preempted = scheduler_output.preempted_request_ids
        if not preempted:
            return
        now = self._clock()
        requests = self._scheduler.requests
        with self._lock:
            for rid in preempted:
                request = requests.get(rid)
                kind = (SWAP if request is not None and request.status == RequestStatus.SWAPPED
                        else RECOMPUTE)
                self._pending_kinds[rid] = kind
                timeline = self._live.get(rid)
                if timeline is not None:
                    timeline.preemptions.append((step, now, kind))
                    timeline._last_kind = None  # a decode run never spans a preemption

    def record_step(self, step: int, t_start: float, t_end: float, scheduler_output,
                    outputs: Iterable, *_more, **_named) -> None:
        sched = self._scheduler
        kv = sched.kv
        outputs = list(outputs)
        finished_now: list[RequestTimeline] = []
        with self._lock:
            live = self._live
            scheduled = []
            num_prefill = num_decode = 0
            tokens_by_tenant = self._tokens_by_tenant
            for s in scheduler_output.scheduled:
                rid, n = s.request_id, s.num_scheduled_tokens
                timeline = live.get(rid)
                tenant = timeline.tenant if timeline is not None else None
                if s.is_decoding:
                    kind = DECODE
                    num_decode += n
                else:
                    kind = PREFILL
                    num_prefill += n
                scheduled.append((rid, n, kind, tenant))
                tokens_by_tenant[tenant] = tokens_by_tenant.get(tenant, 0) + n
                if timeline is not None:
                    timeline._add_chunk(step, n, kind, t_start, t_end)
            preempted = []
            for rid in scheduler_output.preempted_request_ids:
                timeline = live.get(rid)
                preempted.append((rid, self._pending_kinds.pop(rid, RECOMPUTE),
                                  timeline.tenant if timeline is not None else None))
            finished = []
            for out in outputs:
                timeline = live.get(out.request_id)
                if timeline is None:
                    continue
                if out.new_token_ids:
                    if timeline.first_token is None:
                        timeline.first_token = (step, t_end)
                        timeline.num_cached_tokens = out.num_cached_tokens
                    timeline.num_output_tokens += len(out.new_token_ids)
                if out.finish_reason is not None:
                    reason = out.finish_reason.value
                    finished.append((out.request_id, reason))
                    timeline.finish = (step, t_end, reason)
                    finished_now.append(self._retire(timeline))
            self._seq += 1
            self._steps.append(StepRecord(
                self._seq, step, t_start, t_end, tuple(scheduled), tuple(preempted),
                tuple(finished), num_prefill, num_decode, sched.num_running,
                sched.num_waiting, sched.num_swapped, kv.usage))
            second = int(t_end)
            if second != self._sample_second:
                self._sample_second = second
                stats = kv.prefix_stats
                self._samples.append(CounterSample(
                    t_end, dict(tokens_by_tenant), stats.num_queried_tokens,
                    stats.num_hit_tokens, self._seq))
        self._notify(finished_now)

    def record_end(self, request_id: str, reason: str) -> None:
        """A request that ended outside a step (abort, stop string)."""
        with self._lock:
            timeline = self._live.get(request_id)
            if timeline is None:
                return
            timeline.finish = (None, self._clock(), reason)
            done = self._retire(timeline)
        self._notify([done])

    def close(self) -> None:
        pass

    def _retire(self, timeline: RequestTimeline) -> RequestTimeline:
        """Move a finished timeline from live to the bounded finished store (locked)."""
        rid = timeline.request_id
        self._live.pop(rid, None)
        self._pending_kinds.pop(rid, None)
        if self.max_finished:
            self._finished[rid] = timeline
        else:
            self._unindex(timeline)
        while len(self._finished) > self.max_finished:
            _, old = self._finished.popitem(last=False)
            self._unindex(old)
        return timeline

    def _unindex(self, timeline: RequestTimeline) -> None:
        if timeline.parent_id is None:
            return
        ids = self._by_parent.get(timeline.parent_id)
        if ids is not None:
            try:
                ids.remove(timeline.request_id)
            except ValueError:
                pass
            if not ids:
                del self._by_parent[timeline.parent_id]

    def _notify(self, timelines: list[RequestTimeline]) -> None:
        for listener in self._listeners:
            for timeline in timelines:
                listener(timeline)

    # ----- readers (any thread) -------------------------------------------------------------

    @property
    def last_seq(self) -> int:
        return self._seq

    def steps_after(self, seq: int, limit: int | None = None) -> list[StepRecord]:
        """The kept steps with `seq` above the given one, oldest first (at most `limit`,
        the most recent)."""
        with self._lock:
            newest = self._seq
            count = min(newest - seq, len(self._steps))
            if limit is not None:
                count = min(count, limit)
            if count <= 0:
                return []
            steps = self._steps
            return [steps[i] for i in range(len(steps) - count, len(steps))]

    def samples(self) -> list[CounterSample]:
        with self._lock:
            return list(self._samples)

    def timeline(self, request_id: str) -> dict | None:
        """One engine request's timeline (live or among the last finished ones)."""
        with self._lock:
            timeline = self._live.get(request_id) or self._finished.get(request_id)
            return None if timeline is None else timeline.to_dict(self.wall_offset)

    def timelines_of(self, request_id: str) -> list[dict]:
        """Every engine request a user request id names: itself, its samples (n > 1), or
        the prompts of a batched request (`{id}-0`, `{id}-1`, ...)."""
        with self._lock:
            ids = list(self._by_parent.get(request_id, ()))
            if not ids:
                for i in range(1 << 16):
                    more = self._by_parent.get(f"{request_id}-{i}")
                    if more is None:
                        break
                    ids += more
            if not ids and (request_id in self._live or request_id in self._finished):
                ids = [request_id]
            found = [self._live.get(rid) or self._finished.get(rid) for rid in ids]
            return [t.to_dict(self.wall_offset) for t in found if t is not None]

    def tenants_of(self, request_ids: Iterable[str]) -> dict[str, str | None]:
        with self._lock:
            out = {}
            for rid in request_ids:
                timeline = self._live.get(rid) or self._finished.get(rid)
                if timeline is not None:
                    out[rid] = timeline.tenant
            return out

    def live_counts(self) -> dict[str, int]:
        with self._lock:
            return {"live": len(self._live), "finished_kept": len(self._finished)}
