"""Overload control: the bounds a request must pass before it touches the engine.

Owns the counts of requests the server has accepted and not yet started (waiting
requests and their prompt tokens, by priority), each tenant's in-flight requests, each
tenant's tokens in the last minute, and the measured rate at which waiting requests
start. With a queue-delay bound (`max_queue_delay_s`) a request whose predicted wait
exceeds the bound is refused at once: work that would finish after its client gave up is
never started. The prediction is W = (ahead + 1) / (mu - lambda_u): `ahead` the requests
waiting in front of it (under the priority policy, those at least as urgent), mu the
measured start rate, lambda_u the measured arrival rate of strictly more urgent requests,
which keep overtaking it while it waits (fcfs: none). Without that term a background
request admitted behind a short queue waited 4x the bound in the soak, overtaken by the
urgent stream; with lambda_u >= mu it would wait until aging lifts it (refused without aging).
Under aging (`aging_bound` = the scheduler's `priority_aging`: a request that has waited
that many mean waits outranks every class) the overtaking stops there, so the prediction
is at most W_a = (waiting + 1) / mu + aging_bound * mean wait, the mean over the last
minute's starts: without that cap the soak shed two thirds of its priority +5 requests
with predicted waits of 55 s while the ones admitted started within 6 s. A
request beyond a bound is refused at once with the seconds after which a retry may pass
(HTTP 429 with Retry-After); one that no wait could ever admit (it costs more than a
tenant's whole quota) is `NeverAdmissible` (HTTP 400), checked before anything is
counted. Pure bookkeeping: no engine, no I/O, time passed in. Whether a request fits the
engine at all (context, KV cache) is `request_max_tokens`, which asks the engine's limits.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from dataclasses import dataclass


@dataclass(frozen=True)
class AdmissionLimits:
    max_waiting_requests: int
    max_waiting_tokens: int
    tenant_max_concurrent_requests: int
    tenant_tokens_per_minute: int
    """0 means unlimited."""
    max_queue_delay_s: float = 0.0
    """Refuse a request whose predicted wait exceeds this (0: no bound)."""
    priority_ordered: bool = False
    """Waiting requests start most urgent first (the priority policy): a request waits only
    behind those at least as urgent."""
    aging_bound: float = 0.0
    """The priority policy's `priority_aging`: a request that has waited this many mean
    waits outranks every fresh request (0: no such bound)."""


class Overloaded(Exception):
    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = max(1, math.ceil(retry_after_s))


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


@dataclass
class Ticket:
    """One admitted request's share of the counters."""

    tenant: str
    num_prompt_tokens: int
    priority: int = 0
    admitted_at: float = 0.0
    started: bool = False
    released: bool = False


class AdmissionControl:
    _WINDOW_S = 60.0
    _MIN_STARTS = 8
    """Starts seen before the start rate is trusted to predict waits."""

    def __init__(self, limits: AdmissionLimits) -> None:
        self.limits = limits
        self.num_waiting = 0
        self.num_waiting_tokens = 0
        self._waiting_by_priority: dict[int, int] = defaultdict(int)
        self._starts: deque[tuple[float, float]] = deque()
        """(time, seconds waited) of the starts of the last minute."""
        self._arrivals: deque[tuple[float, int]] = deque()
        """(time, priority) of the admitted requests of the last minute."""
        self._in_flight: dict[str, int] = defaultdict(int)
        self._recent_tokens: dict[str, deque[tuple[float, int]]] = defaultdict(deque)

    def start_rate(self, now: float) -> float | None:
        """Waiting requests started per second over the last minute; None until enough
        have started to tell."""
        starts = self._starts
        while starts and starts[0][0] <= now - self._WINDOW_S:
            starts.popleft()
        if len(starts) < self._MIN_STARTS:
            return None
        span = max(now - starts[0][0], 1.0)
        return len(starts) / span

    def mean_wait(self, now: float) -> float | None:
        """Mean seconds from admission to start over the last minute's starts (None
        until the start rate is known)."""
        if self.start_rate(now) is None:
            return None
        return sum(w for _, w in self._starts) / len(self._starts)

    def overtaking_rate(self, priority: int, now: float) -> float:
        """Admitted requests per second, over the last minute, that start before a waiting
        request of this priority although they arrive after it (priority policy only)."""
        arrivals = self._arrivals
        while arrivals and arrivals[0][0] <= now - self._WINDOW_S:
            arrivals.popleft()
        if not self.limits.priority_ordered or not arrivals:
            return 0.0
        span = max(now - arrivals[0][0], 1.0)
        return sum(1 for _, p in arrivals if p < priority) / span

    def predicted_wait(self, priority: int, now: float) -> float | None:
        """Seconds a request of this priority would wait to start, if it came now (inf
        when more urgent arrivals alone take every start)."""
        rate = self.start_rate(now)
        if rate is None:
            return None
        if self.limits.priority_ordered:
            ahead = sum(n for p, n in self._waiting_by_priority.items() if p <= priority)
        else:
            ahead = self.num_waiting
        spare = rate - self.overtaking_rate(priority, now)
        wait = (ahead + 1) / spare if spare > 0 else math.inf
        if self.limits.priority_ordered and self.limits.aging_bound > 0:
            aged = (self.num_waiting + 1) / rate + self.limits.aging_bound * self.mean_wait(now)
            wait = min(wait, aged)
        return wait

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

    def admit(self, tenant: str, num_prompt_tokens: int, max_tokens: int, now: float,
              priority: int = 0) -> Ticket:
        """Count the request in, or raise Overloaded naming the bound it hit
        (NeverAdmissible first, if it can never pass)."""
        self.check_admissible(num_prompt_tokens, max_tokens)
        lim = self.limits
        if lim.max_queue_delay_s > 0:
            wait = self.predicted_wait(priority, now)
            if wait is not None and wait > lim.max_queue_delay_s:
                rate = self.start_rate(now)
                retry = (wait - lim.max_queue_delay_s + 1.0 / rate if math.isfinite(wait)
                         else self._WINDOW_S)
                about = f"about {wait:.1f} s" if math.isfinite(wait) else "until aging lifts it"
                raise Overloaded(
                    f"server overloaded: a request of priority {priority} would wait {about} "
                    f"to start (max_queue_delay={lim.max_queue_delay_s:g} s)", retry)
        if self.num_waiting + 1 > lim.max_waiting_requests:
            raise Overloaded(f"server overloaded: {self.num_waiting} requests waiting "
                             f"(max_waiting_requests={lim.max_waiting_requests})", 1)
        if self.num_waiting_tokens + num_prompt_tokens > lim.max_waiting_tokens:
            raise Overloaded(f"server overloaded: {self.num_waiting_tokens} prompt tokens "
                             f"waiting (max_waiting_tokens={lim.max_waiting_tokens})", 1)
        if self._in_flight[tenant] + 1 > lim.tenant_max_concurrent_requests:
            raise Overloaded(f"tenant {tenant!r} has {self._in_flight[tenant]} requests in "
                             f"flight (tenant_max_concurrent_requests="
                             f"{lim.tenant_max_concurrent_requests})", 1)
        cost = num_prompt_tokens + max_tokens
        if lim.tenant_tokens_per_minute:
            used = self._tokens_last_minute(tenant, now)
            if used + cost > lim.tenant_tokens_per_minute:
                window = self._recent_tokens[tenant]
                freed, retry = 0, self._WINDOW_S
                for t, n in window:  # wait until enough of the window has expired
                    freed += n
                    if used - freed + cost <= lim.tenant_tokens_per_minute:
                        retry = t + self._WINDOW_S - now
                        break
                raise Overloaded(f"tenant {tenant!r} used {used} tokens in the last minute "
                                 f"(tenant_tokens_per_minute={lim.tenant_tokens_per_minute})",
                                 retry)
            self._recent_tokens[tenant].append((now, cost))
        self.num_waiting += 1
        self.num_waiting_tokens += num_prompt_tokens
        self._waiting_by_priority[priority] += 1
        if lim.max_queue_delay_s > 0 and lim.priority_ordered:  # read by predicted_wait only
            self._arrivals.append((now, priority))
        self._in_flight[tenant] += 1
        return Ticket(tenant, num_prompt_tokens, priority, now)

    def started(self, ticket: Ticket, now: float | None = None) -> None:
        """The request produced its first output (at `now`): it no longer waits. A
        request that ends without starting is not a start (see `release`)."""
        if not ticket.started and not ticket.released:
            ticket.started = True
            self.num_waiting -= 1
            self.num_waiting_tokens -= ticket.num_prompt_tokens
            self._waiting_by_priority[ticket.priority] -= 1
            if now is not None:
                self._starts.append((now, max(now - ticket.admitted_at, 0.0)))

    def release(self, ticket: Ticket) -> None:
        """The request ended (any way): drop it from every count, once."""
        if ticket.released:
            return
        self.started(ticket)
        ticket.released = True
        self._in_flight[ticket.tenant] -= 1
