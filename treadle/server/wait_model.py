"""How long a new request would wait for the engine: the prediction behind `max_queue_delay`.

Owns the measurements the server can make of its engine from the outputs it passes on
(the time per generated token of running requests, how many requests run at once while
others wait, how much of `max_tokens` requests use), and the prediction made from them
and from the work already admitted: the engine is `N` slots; a running request frees its
slot after its remaining tokens; the waiting requests ahead take slots in the order the
engine will start them, each holding one for its prompt's chunks and its expected output;
the new request starts when the next slot frees after them. In steps, times the measured
seconds per token: a min-heap over the slots, O(waiting x log N) per admission.

Why slots and not a start rate: the first prediction divided the queue by the rate of
starts over the last minute, and refused nothing until 8 requests had started in that
minute. Under deep overload (long outputs, few starts a minute) that was exactly when the
rate went missing, and everything was admitted: the issue's soak (`--max-queue-delay 10`)
accepted 201 requests of which 104 hit the client's 60 s timeout. The work admitted is
known at every admission; only the time per token has to be measured: the engine's own
timing of finished requests (first token to finish), and until one has finished the gaps
between outputs as the server passes them on. Options weighed: queued tokens x cost per token
(the fluid bound: the time to finish everything admitted, pessimistic by the whole
running batch's work, since the new request starts when one slot frees, not all); the
start rate (above); the slots (chosen: exact for a full engine whose requests decode one
token per step, and it reads the running requests' remaining work).

Pure bookkeeping: no engine, no I/O, time passed in.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass

PRIOR_OUTPUT_TOKENS = 256
"""Expected output of a request before any has finished, when its max_tokens is larger."""
_MIN_FINISHED = 8
"""Finished requests seen before their share of max_tokens replaces the prior."""
_GAP_WINDOW = 512
_FINISHED_WINDOW = 256
_CONCURRENCY_WINDOW_S = 60.0


@dataclass
class Slotted:
    """One admitted request as the prediction sees it."""

    prompt_tokens: int
    max_tokens: int
    generated: int = 0


def start_in_steps(remaining: list[float], ahead: list[float], num_slots: int) -> float:
    """Steps until a new request gets one of `num_slots` slots: the running requests hold
    theirs for `remaining` more steps each (more running than slots: they all hold one),
    and the waiting requests ahead take the next free ones in order, each for its steps."""
    slots = sorted(remaining)
    slots += [0.0] * max(0, num_slots - len(slots))
    heapq.heapify(slots)
    for steps in ahead:
        heapq.heapreplace(slots, slots[0] + steps)
    return slots[0]


class ServiceModel:
    """What the server measures of its engine, and the wait it predicts from it."""

    def __init__(self, max_num_seqs: int, step_token_budget: int, num_kv_tokens: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.step_token_budget = max(1, step_token_budget)
        self.num_kv_tokens = num_kv_tokens
        self._gaps: deque[float] = deque(maxlen=_GAP_WINDOW)
        """Seconds per generated token between two outputs of a running request, as the
        server passed them on (a slow client stretches them: the start-up fallback)."""
        self._tpots: deque[float] = deque(maxlen=_FINISHED_WINDOW)
        """Seconds per token of finished requests, first token to finish, as the engine
        timed them (what a slot does, whoever reads the stream)."""
        self._finished: deque[tuple[int, int]] = deque(maxlen=_FINISHED_WINDOW)
        """(tokens generated, max_tokens) of requests that finished normally."""
        self._concurrency: deque[tuple[float, int]] = deque()
        """(time, running requests) seen at starts while others waited."""
        self._step_s: float | None = None
        self._step_s_at = -math.inf

    # ----- measurements ------------------------------------------------------------------

    def note_gap(self, seconds: float, num_tokens: int) -> None:
        """A running request received `num_tokens` new tokens `seconds` after its last."""
        if num_tokens > 0 and seconds >= 0:
            self._gaps.append(seconds / num_tokens)

    def note_finished(self, generated: int, max_tokens: int,
                      seconds_per_token: float | None = None) -> None:
        """A request ran to its end: its output against its max_tokens, and the engine's
        time per token for it (first token to finish over the tokens after the first)."""
        if max_tokens > 0:
            self._finished.append((generated, max_tokens))
        if seconds_per_token is not None and seconds_per_token > 0:
            self._tpots.append(seconds_per_token)

    def note_saturated(self, num_running: int, now: float) -> None:
        """A request started while others still waited: `num_running` is what the engine
        runs at once under this load (its slots, bounded by max_num_seqs or the KV cache)."""
        self._concurrency.append((now, num_running))
        while self._concurrency and self._concurrency[0][0] < now - _CONCURRENCY_WINDOW_S:
            self._concurrency.popleft()

    def step_seconds(self, now: float) -> float | None:
        """Seconds per token of a running request (one step when it decodes a token per
        step): the mean over the recent finished requests as the engine timed them, else
        (until one finishes) over the gaps between the outputs passed on, without
        outliers (over 8x the median: a preemption or a pause, not a step); None until
        two outputs of one request were seen. Recomputed at most twice a second."""
        samples = self._tpots or self._gaps
        if now - self._step_s_at >= 0.5 and samples:
            ordered = sorted(samples)
            median = ordered[len(ordered) // 2]
            kept = [g for g in ordered if g <= 8 * median] or ordered
            self._step_s, self._step_s_at = sum(kept) / len(kept), now
        return self._step_s

    def output_share(self) -> float | None:
        """Tokens generated over max_tokens, over the recent finished requests (None
        until enough have finished)."""
        if len(self._finished) < _MIN_FINISHED:
            return None
        return sum(g for g, _ in self._finished) / sum(m for _, m in self._finished)

    def expected_output(self, max_tokens: int, share: float | None) -> float:
        if share is None:
            return float(min(max_tokens, PRIOR_OUTPUT_TOKENS))
        return max(1.0, max_tokens * share)

    def num_slots(self, admitted: list[Slotted], num_running: int) -> int:
        """Requests the engine runs at once: the most seen running while others waited
        over the last minute; before any such moment, max_num_seqs bounded by the KV cache
        holding requests of the size of those admitted halfway through their output (the
        scheduler admits on what a request needs soon, not at its end)."""
        if self._concurrency:
            seen = max(n for _, n in self._concurrency)
        else:
            share = self.output_share()
            sizes = [r.prompt_tokens + self.expected_output(r.max_tokens, share) / 2
                     for r in admitted] or [1.0]
            seen = int(self.num_kv_tokens // max(1.0, sum(sizes) / len(sizes)))
            seen = min(self.max_num_seqs, seen)
        return max(1, seen, num_running)

    # ----- the prediction --------------------------------------------------------------------

    def slot_steps(self, request: Slotted, share: float | None) -> float:
        """Steps a waiting request will hold a slot: its prompt's chunks, then its output."""
        chunks = math.ceil(request.prompt_tokens / self.step_token_budget)
        return chunks + self.expected_output(request.max_tokens, share)

    def predict_wait(self, running: list[Slotted], ahead: list[Slotted], now: float,
                     num_slots: int | None = None) -> float | None:
        """Seconds until a new request gets a slot, behind `ahead` (waiting, in start
        order) and `running`; None while the step time is unmeasured."""
        step_s = self.step_seconds(now)
        if step_s is None:
            return None
        share = self.output_share()
        remaining = [max(1.0, self.expected_output(r.max_tokens, share) - r.generated)
                     for r in running]
        slots = num_slots if num_slots is not None else self.num_slots(running + ahead,
                                                                      len(running))
        steps = start_in_steps(remaining, [self.slot_steps(r, share) for r in ahead], slots)
        return steps * step_s
