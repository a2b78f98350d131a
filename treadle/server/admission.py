"""Overload control: whether a request may enter the engine, decided before any work on it.

Owns the counts of requests the server has accepted (waiting: not started; running: a
first token out), their prompt tokens, each tenant's in-flight requests and tokens in the
last minute, and the verdict for a new request. The verdict comes before tokenization,
grammar compilation or any model work (`reserve`, with the prompt's size estimated from
its text: UTF-8 bytes / 4, exact for token ids), and has two answers beside "yes":

- the tenant is over its own limits (`tenant_max_concurrent_requests`,
  `tenant_tokens_per_minute`): `Overloaded` with status 429 and the seconds after which
  its window frees enough;
- the server is saturated (the predicted wait for a slot exceeds `max_queue_delay_s`, or
  `max_waiting_requests` / `max_waiting_tokens` are reached): status 503 with the
  seconds after which the backlog will have drained enough.

Each refusal names its `reason` (the label of treadle:request_rejections_total). Once
the request is tokenized, `settle` replaces the estimate by the exact count; only a
request that can never pass (`NeverAdmissible`: a cost over the tenant's whole quota, a
prompt larger than the whole waiting queue) is refused then, as a 400.

The wait is predicted from the work already admitted (server/wait_model.py): the engine's
slots, the running requests' remaining tokens, the waiting requests ahead (under the
priority policy those at least as urgent) and the measured time per token. Under the
priority policy more urgent requests keep arriving and overtake a waiting one: the wait
is divided by 1 - rho_u, rho_u the share of the slots the more urgent arrivals of the
last minute take (refused outright when they take them all). Under aging
(`aging_bound` = the scheduler's `priority_aging`: a request that has waited that many
mean waits outranks every class) the overtaking stops there, so the prediction is at
most the wait behind every waiting request plus aging_bound x the last minute's mean
wait (without that cap the soak shed two thirds of its priority +5 requests with
predicted waits of 55 s while those admitted started within 6 s).

Pure bookkeeping: no engine, no I/O, time passed in. Whether a request fits the engine
at all (context, KV cache) is `request_max_tokens`, which asks the engine's limits.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from dataclasses import dataclass, field

from treadle.server.wait_model import ServiceModel, Slotted


@dataclass(frozen=True)
class AdmissionLimits:
    max_waiting_requests: int
    max_waiting_tokens: int
    tenant_max_concurrent_requests: int
    tenant_tokens_per_minute: int
    """0 means unlimited."""
    max_queue_delay_s: float = 0.0
    """Refuse a request whose predicted wait for a slot exceeds this (0: no bound)."""
    priority_ordered: bool = False
    """Waiting requests start most urgent first (the priority policy): a request waits only
    behind those at least as urgent."""
    aging_bound: float = 0.0
    """The priority policy's `priority_aging`: a request that has waited this many mean
    waits outranks every fresh request (0: no such bound)."""
    max_num_seqs: int = 128
    """The engine's most running requests (its slots, unless the KV cache holds fewer)."""
    step_token_budget: int = 512
    """The engine's tokens per step (max_num_batched_tokens): a prompt's chunks."""
    num_kv_tokens: int = 1 << 30
    """Tokens the engine's KV cache holds (how many requests can run at once)."""


class Overloaded(Exception):
    """Refused for now: `status` 503 (the server is saturated) or 429 (the tenant is over
    its limits), `retry_after_s` when a retry may pass, `reason` the metric's label."""

    def __init__(self, message: str, retry_after_s: float, reason: str = "queue_delay",
                 status: int = 503) -> None:
        super().__init__(message)
        self.retry_after_s = max(1, math.ceil(min(retry_after_s, 3600)))
        self.reason, self.status = reason, status


class NeverAdmissible(ValueError):
    """The request exceeds a bound on its own: retrying can never succeed."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def request_max_tokens(limits, num_prompt: int, requested: int | None,
                       default: int | None) -> int:
    """max_tokens for a prompt of `num_prompt` tokens: the requested count, else the
    default cut to what fits (the context and the KV cache). NeverAdmissible naming the
    field and the limit when the engine would refuse the request: the rule is the engine
    core's own (`EngineLimits.length_error`, engine/limits.py), never a copy."""
    if not num_prompt:
        raise NeverAdmissible("prompt is empty: at least one token is needed", "prompt")
    fits = max(1, limits.max_request_tokens - num_prompt)
    max_tokens = requested if requested is not None else min(default or fits, fits)
    error = limits.length_error(num_prompt, max_tokens)
    if error is not None:
        raise NeverAdmissible(error.message, error.field)
    return max_tokens


def estimate_tokens(text: str) -> int:
    """A prompt's tokens before tokenizing it: UTF-8 bytes / 4 (English under a byte-level
    BPE runs ~4 bytes a token), at least 1."""
    return max(1, -(-len(text.encode("utf-8", "replace")) // 4))


def prompt_tokens(prompt: str | list) -> int:
    """A completion prompt's tokens before tokenizing: ids counted, text estimated."""
    return estimate_tokens(prompt) if isinstance(prompt, str) else max(1, len(prompt))


def conversation_tokens(texts: list[str], tools: list | None = None) -> int:
    """A conversation's tokens before its chat template: each message's text estimated,
    plus 4 for the template's markup around it, plus the tools' JSON."""
    total = sum(estimate_tokens(text) + 4 for text in texts)
    if tools:
        import json
        total += estimate_tokens(json.dumps(tools))
    return total


@dataclass(eq=False)
class Ticket:
    """One admitted request's share of the counters."""

    tenant: str
    num_prompt_tokens: int
    priority: int = 0
    admitted_at: float = 0.0
    max_tokens: int = 1
    started: bool = False
    ended: bool = False
    """Its last output came: it holds no slot, though its stream may still be sent."""
    released: bool = False
    generated: int = 0
    settled_at: float | None = None
    """When it was handed to the engine (its exact size known)."""
    last_output_at: float | None = None
    window_entry: list = field(default_factory=list)
    """[time, tokens] of its charge in the tenant's tokens-per-minute window (if any)."""

    def slotted(self) -> Slotted:
        return Slotted(self.num_prompt_tokens, self.max_tokens, self.generated)


class AdmissionControl:
    _WINDOW_S = 60.0

    def __init__(self, limits: AdmissionLimits) -> None:
        self.limits = limits
        self.service = ServiceModel(limits.max_num_seqs, limits.step_token_budget,
                                    limits.num_kv_tokens)
        self.num_waiting = 0
        self.num_waiting_tokens = 0
        self._tickets: dict[int, Ticket] = {}
        """Every ticket not yet released, in admission order (by id)."""
        self._starts: deque[tuple[float, float]] = deque()
        """(time, seconds waited) of the starts of the last minute."""
        self._arrivals: deque[tuple[float, int, float]] = deque()
        """(time, priority, slot steps) of the admitted requests of the last minute."""
        self._in_flight: dict[str, int] = defaultdict(int)
        self._recent_tokens: dict[str, deque[list]] = defaultdict(deque)

    # ----- what the prediction reads ----------------------------------------------------

    @property
    def num_running(self) -> int:
        return sum(1 for t in self._tickets.values() if t.started and not t.ended)

    def queue_bound(self, now: float) -> tuple[int, int, float] | None:
        """(waiting requests the wait bound admits, slots, seconds per token) for requests
        of the size admitted so far: the queue's length in numbers, from the KV capacity
        (the slots) and the measured cost per token; None before it is measured."""
        step_s = self.service.step_seconds(now)
        if step_s is None or self.limits.max_queue_delay_s <= 0:
            return None
        admitted = [t.slotted() for t in self._tickets.values()]
        slots = self.service.num_slots(admitted, self.num_running)
        share = self.service.output_share()
        per_request = (sum(self.service.slot_steps(r, share) for r in admitted) / len(admitted)
                       if admitted else self.service.slot_steps(Slotted(1, 1), share))
        turns = self.limits.max_queue_delay_s / (per_request * step_s)
        return int(slots * turns), slots, step_s

    def mean_wait(self, now: float) -> float | None:
        """Mean seconds from admission to start over the last minute's starts."""
        starts = self._starts
        while starts and starts[0][0] <= now - self._WINDOW_S:
            starts.popleft()
        return sum(w for _, w in starts) / len(starts) if starts else None

    def overtaking_share(self, priority: int, now: float, num_slots: int,
                         step_s: float) -> float:
        """The share of the engine's slots that more urgent arrivals took over the last
        minute (priority policy only): they start before a waiting request of this
        priority although they arrive after it."""
        arrivals = self._arrivals
        while arrivals and arrivals[0][0] <= now - self._WINDOW_S:
            arrivals.popleft()
        if not self.limits.priority_ordered or not arrivals:
            return 0.0
        span = max(now - arrivals[0][0], 1.0)
        urgent_steps = sum(steps for _, p, steps in arrivals if p < priority)
        return urgent_steps * step_s / (span * num_slots)

    def predicted_wait(self, priority: int, now: float) -> float | None:
        """Seconds a request of this priority would wait for a slot if it came now (inf
        when more urgent arrivals alone take every slot); None until the engine's time
        per token is measured."""
        service = self.service
        running = [t.slotted() for t in self._tickets.values() if t.started and not t.ended]
        waiting = [t for t in self._tickets.values() if not t.started]
        step_s = service.step_seconds(now)
        if step_s is None:
            return None
        slots = service.num_slots(running + [t.slotted() for t in waiting], len(running))
        if not self.limits.priority_ordered:
            return service.predict_wait(running, [t.slotted() for t in waiting], now, slots)
        ahead = sorted((t for t in waiting if t.priority <= priority),
                       key=lambda t: (t.priority, t.admitted_at))
        wait = service.predict_wait(running, [t.slotted() for t in ahead], now, slots)
        rho = self.overtaking_share(priority, now, slots, step_s)
        wait = wait / (1 - rho) if rho < 1 else math.inf
        mean_wait = self.mean_wait(now)
        if self.limits.aging_bound > 0 and mean_wait is not None:
            behind_all = service.predict_wait(running, [t.slotted() for t in waiting], now,
                                              slots)
            wait = min(wait, behind_all + self.limits.aging_bound * mean_wait)
        return wait

    # ----- the verdict --------------------------------------------------------------------

    def _tokens_last_minute(self, tenant: str, now: float) -> int:
        window = self._recent_tokens[tenant]
        while window and window[0][0] <= now - self._WINDOW_S:
            window.popleft()
        return sum(n for _, n in window)

    def check_admissible(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise NeverAdmissible if no wait could ever admit a request of this size."""
        if num_prompt_tokens > self.limits.max_waiting_tokens:
            raise NeverAdmissible(
                f"prompt: {num_prompt_tokens} tokens, more than the whole waiting queue holds "
                f"({self.limits.max_waiting_tokens} tokens, max_waiting_tokens)", "prompt")
        cost = num_prompt_tokens + max_tokens
        quota = self.limits.tenant_tokens_per_minute
        if quota and cost > quota:
            raise NeverAdmissible(
                f"max_tokens: prompt ({num_prompt_tokens} tokens) + max_tokens x n "
                f"({max_tokens}) = {cost} tokens, more than the tenant's whole quota of "
                f"{quota} tokens per minute (tenant_tokens_per_minute)", "max_tokens")

    def _check_tenant(self, tenant: str, cost: int, now: float) -> None:
        """429s: the tenant's own limits."""
        lim = self.limits
        if self._in_flight[tenant] + 1 > lim.tenant_max_concurrent_requests:
            raise Overloaded(f"tenant {tenant!r} has {self._in_flight[tenant]} requests in "
                             f"flight (tenant_max_concurrent_requests="
                             f"{lim.tenant_max_concurrent_requests})", 1,
                             "tenant_concurrency", 429)
        quota = lim.tenant_tokens_per_minute
        if quota and cost <= quota:  # a cost over the whole quota is settle's 400
            used = self._tokens_last_minute(tenant, now)
            if used + cost > quota:
                freed, retry = 0, self._WINDOW_S
                for t, n in self._recent_tokens[tenant]:  # until enough has expired
                    freed += n
                    if used - freed + cost <= quota:
                        retry = t + self._WINDOW_S - now
                        break
                raise Overloaded(f"tenant {tenant!r} used {used} tokens in the last minute "
                                 f"(tenant_tokens_per_minute={quota})", retry,
                                 "tenant_tokens", 429)

    def _check_server(self, num_prompt_tokens: int, priority: int, now: float) -> None:
        """503s: the server's backlog."""
        lim = self.limits
        wait = self.predicted_wait(priority, now) if lim.max_queue_delay_s > 0 else None
        if wait is not None and wait > lim.max_queue_delay_s:
            retry = wait - lim.max_queue_delay_s + 1.0 if math.isfinite(wait) else self._WINDOW_S
            about = (f"about {wait:.1f} s for the engine" if math.isfinite(wait)
                     else "for the engine as long as more urgent requests take every slot")
            raise Overloaded(f"server overloaded: a request of priority {priority} would wait "
                             f"{about} (max_queue_delay="
                             f"{lim.max_queue_delay_s:g} s)", retry, "queue_delay")
        per_start = (wait / (self.num_waiting + 1) if wait is not None and math.isfinite(wait)
                     else 1.0)
        if self.num_waiting + 1 > lim.max_waiting_requests:
            raise Overloaded(f"server overloaded: {self.num_waiting} requests waiting "
                             f"(max_waiting_requests={lim.max_waiting_requests})", per_start,
                             "queue_requests")
        if self.num_waiting_tokens + num_prompt_tokens > lim.max_waiting_tokens:
            raise Overloaded(f"server overloaded: {self.num_waiting_tokens} prompt tokens "
                             f"waiting (max_waiting_tokens={lim.max_waiting_tokens})",
                             per_start, "queue_tokens")

    def reserve(self, tenant: str, num_prompt_tokens: int, max_tokens: int, now: float,
                priority: int = 0) -> Ticket:
        """Count a request in from its size as known before tokenization (estimated prompt
        tokens), or raise Overloaded: the tenant's limits first (429), then the server's
        backlog (503)."""
        cost = num_prompt_tokens + max_tokens
        self._check_tenant(tenant, cost, now)
        self._check_server(num_prompt_tokens, priority, now)
        ticket = Ticket(tenant, num_prompt_tokens, priority, now, max(1, max_tokens))
        if self.limits.tenant_tokens_per_minute:
            ticket.window_entry = [now, cost]
            self._recent_tokens[tenant].append(ticket.window_entry)
        self.num_waiting += 1
        self.num_waiting_tokens += num_prompt_tokens
        if self.limits.priority_ordered:  # read by overtaking_share only
            self._arrivals.append((now, priority,
                                   self.service.slot_steps(ticket.slotted(),
                                                           self.service.output_share())))
        self._in_flight[tenant] += 1
        self._tickets[id(ticket)] = ticket
        return ticket

    def settle(self, ticket: Ticket, num_prompt_tokens: int, max_tokens: int,
               now: float = 0.0) -> None:
        """The request's exact size, once tokenized (NeverAdmissible when no wait could
        ever admit it; the caller releases the ticket then)."""
        self.check_admissible(num_prompt_tokens, max_tokens)
        if not ticket.started and not ticket.released:
            self.num_waiting_tokens += num_prompt_tokens - ticket.num_prompt_tokens
        ticket.num_prompt_tokens, ticket.max_tokens = num_prompt_tokens, max(1, max_tokens)
        ticket.settled_at = now
        if ticket.window_entry:
            ticket.window_entry[1] = num_prompt_tokens + max_tokens

    def admit(self, tenant: str, num_prompt_tokens: int, max_tokens: int, now: float,
              priority: int = 0) -> Ticket:
        """`reserve` and `settle` at once, for a request whose size is known exactly
        (NeverAdmissible first, before anything is counted)."""
        self.check_admissible(num_prompt_tokens, max_tokens)
        ticket = self.reserve(tenant, num_prompt_tokens, max_tokens, now, priority)
        ticket.settled_at = now
        return ticket

    # ----- what happens to an admitted request ----------------------------------------------

    def started(self, ticket: Ticket, now: float | None = None) -> None:
        """The request produced its first output (at `now`): it no longer waits. A
        request that ends without starting is not a start (see `release`)."""
        if ticket.started or ticket.released:
            return
        ticket.started = True
        self.num_waiting -= 1
        self.num_waiting_tokens -= ticket.num_prompt_tokens
        if now is not None:
            self._starts.append((now, max(now - ticket.admitted_at, 0.0)))
            if self._engine_full(now):
                self.service.note_saturated(self.num_running, now)

    def _engine_full(self, now: float) -> bool:
        """Whether a request handed to the engine has waited there longer than its
        prompt's chunks and two more steps: the engine runs all it can (a request still
        being tokenized, or just handed over, says nothing of the engine)."""
        step_s = self.service.step_seconds(now)
        if step_s is None:
            return False
        budget = self.limits.step_token_budget
        return any(not t.started and t.settled_at is not None
                   and now - t.settled_at > (math.ceil(t.num_prompt_tokens / budget) + 2) * step_s
                   for t in self._tickets.values())

    def progressed(self, ticket: Ticket, num_generated: int, now: float,
                   ended: bool = False) -> None:
        """The request has `num_generated` tokens at `now` (after each of its outputs;
        `ended`: that was its last, its slot is free)."""
        self.started(ticket, now)
        ticket.ended = ticket.ended or ended
        if ticket.last_output_at is not None and num_generated > ticket.generated:
            self.service.note_gap(now - ticket.last_output_at, num_generated - ticket.generated)
        if num_generated > ticket.generated or ticket.last_output_at is None:
            ticket.last_output_at = now
        ticket.generated = max(ticket.generated, num_generated)

    def release(self, ticket: Ticket, completed: bool = False,
                seconds_per_token: float | None = None) -> None:
        """The request ended (any way; `completed`: it ran to its end, so its output
        length tells what share of max_tokens requests use, and `seconds_per_token` is the
        engine's time per token for it): drop it from every count, once."""
        if ticket.released:
            return
        self.started(ticket)
        ticket.released = ticket.ended = True
        self._in_flight[ticket.tenant] -= 1
        self._tickets.pop(id(ticket), None)
        if completed:
            self.service.note_finished(ticket.generated, ticket.max_tokens, seconds_per_token)


class Reservation:
    """The tickets a request took before its prompts were tokenized (serving.reserve):
    given back when the block it guards ends without `settle` taking them (a 400 found
    while tokenizing, a grammar that does not compile, a client gone)."""

    def __init__(self, admission: AdmissionControl, tickets: list[Ticket]) -> None:
        self.admission, self.tickets = admission, tickets
        self.taken = False

    def __enter__(self) -> "Reservation":
        return self

    def __exit__(self, *exc_info) -> bool:
        if not self.taken:
            for ticket in self.tickets:
                self.admission.release(ticket)
        return False
