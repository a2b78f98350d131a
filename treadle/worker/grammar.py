"""The worker's side of structured outputs: grammar state per constrained request, token
masks computed while the forward pass runs, and masks applied before sampling.

Owns, on the rank that samples, the process's `GrammarCompiler` for the model's
tokenizer (`GrammarCompiler.shared`: in the server's process it is the server's, which
compiled the request's grammar at admission; built on a pool thread when the first
constrained request arrives otherwise: `warm_up`, a one-time cost of a few tenths of a
second, part of it holding the GIL) and a `StructuredRequest` per live constrained
request (treadle/structured), made when the worker first sees the request (`prepare`,
from its first step, usually a prompt chunk) on a compile thread at the idle scheduling
class: a cache hit costs a matcher copy, and a compile (a worker in its own process)
never runs on the engine's thread nor takes a core from the forward pass. Each step:
`start(rows)` submits, per constrained request, one job to a small thread pool that
brings its matcher to its tokens as the step message says (`sync`: cheap when one token
was added; it also undoes whatever a preemption or a rejected proposal took back) and
fills the mask of its sampling position. llguidance drops the GIL in both, so the jobs
run while the model's forward pass does. `masks()` waits for them and gives (bitmask,
logits rows) for the sampler, which applies them after logit_bias and penalties and
before temperature and sampling. Positions after proposed tokens (speculative decoding)
are masked as if those tokens had been accepted. Unconstrained rows are never touched.
It decides nothing: ending a request whose grammar is complete is the scheduler's (its
end-of-sequence is then the only token allowed).

Nothing a grammar does raises out of here. A request whose grammar fails at run time (its
spec does not compile here, the parser hits one of its limits, or its sync and mask take
longer than `mask_budget_s` in one step) is reported in `failed` (request id -> message)
with its row left all-allowed: the runner reports it, and the scheduler ends that request
alone with finish reason 'error' and drops the token drawn for it. Each request's work is
timed on its own (one job each), so a batch of many cheap masks is never blamed on one,
in CPU time of the job's thread (llguidance computes one matcher's mask on the calling
thread), so a busy machine that deschedules the job does not fail a request that did
little work (seen: a plain schema's 94 ms of wall time at a load of 6 on 2 cores).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

DEFAULT_MASK_BUDGET_S = 0.05
"""A request's grammar work (sync + mask) may take this much CPU time in one step."""


@dataclass
class StepMasks:
    """A step's token masks: row i of `bitmask` masks sampling position `rows[i]`."""

    bitmask: torch.Tensor
    rows: list[int]


@dataclass
class _Job:
    """One constrained request's sampling position of this step."""

    request_id: str
    spec: object
    matcher: concurrent.futures.Future
    """Resolves to the request's StructuredRequest (compiled on the pool)."""
    row: int
    proposed: list[int]
    future: concurrent.futures.Future | None = None


class GrammarState:
    """Grammar matchers of the constrained requests of one worker."""

    def __init__(self, model_dir: Path, vocab_size: int, eos_token_id: int | None,
                 mask_budget_s: float = DEFAULT_MASK_BUDGET_S,
                 num_threads: int | None = None) -> None:
        """`num_threads`: jobs run at once (default: half the CPUs, 1 to 8)."""
        self.model_dir, self.vocab_size, self.eos_token_id = model_dir, vocab_size, eos_token_id
        self.mask_budget_s = mask_budget_s
        self.num_threads = num_threads or max(1, min(8, (os.cpu_count() or 2) // 2))
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._compiles: concurrent.futures.ThreadPoolExecutor | None = None
        self._compiler: concurrent.futures.Future | None = None
        self._requests: dict[str, concurrent.futures.Future] = {}
        """Each live constrained request's matcher (a future: compiled on the pool)."""
        self._pending: tuple[torch.Tensor, list[_Job], list[int]] | None = None
        self.failed: dict[str, str] = {}
        """Requests whose grammar failed this step (id -> message), reset by `start`."""

    def _submit(self, fn, *args) -> concurrent.futures.Future:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=self.num_threads, thread_name_prefix="treadle-grammar")
        return self._pool.submit(fn, *args)

    def _compile_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        """Where a request's grammar is compiled when the server has not (a worker in its
        own process) or its compile was evicted: one thread at the idle scheduling class,
        so a compile takes only a core the forward pass leaves idle. Masks stay on the
        normal-priority pool: the step waits for them."""
        if self._compiles is None:
            from treadle.thread_priority import idle_thread_pool
            self._compiles = idle_thread_pool(1, "treadle-grammar-compile")
        return self._compiles

    def warm_up(self) -> None:
        """Start building the grammar compiler for the model's tokenizer on the pool (the
        tokenizer's load and llguidance's token trie: a few tenths of a second)."""
        if self._compiler is None:
            self._compiler = self._submit(self._build_compiler)

    def _build_compiler(self):
        from treadle.models.tokenizer import load_tokenizer
        from treadle.structured.compiler import GrammarCompiler

        return GrammarCompiler.shared(self.model_dir, lambda: load_tokenizer(self.model_dir),
                                      self.vocab_size, self.eos_token_id)

    def prepare(self, requests) -> None:
        """Compile the grammars of requests the worker sees for the first time (id,
        spec), on the pool: they are ready by the step that first samples them (a
        prompt's first chunk starts this while the model runs)."""
        for request_id, spec in requests:
            if request_id not in self._requests:
                self.warm_up()
                self._requests[request_id] = self._compile_pool().submit(
                    self._new_request, spec)

    def _new_request(self, spec):
        return self._compiler.result().new_request(spec)

    def drop(self, request_ids) -> None:
        for request_id in request_ids:
            self._requests.pop(request_id, None)

    def _fail(self, request_id: str, spec, message: str) -> None:
        text = f"{getattr(spec, 'field', 'structured_outputs')}: {message}"
        if request_id not in self.failed:
            logger.warning("request %s ended: %s", request_id, text)
            self.failed[request_id] = text
        self._requests.pop(request_id, None)

    def start(self, positions: list[tuple[int, str, object, list[int], list[int]]]) -> None:
        """Submit the sync and mask of each sampling position. `positions` holds, per
        sampling position of a constrained request: (its logits row, request id, its spec,
        its generated tokens, the proposed tokens before this position), a request's
        first position (no proposals before it) first."""
        if self._pending is not None:  # a step whose masks were never taken: finish it
            self.masks()
        self.failed = {}
        if not positions:
            return
        from treadle.structured.matcher import allocate_bitmask

        with torch.inference_mode(False):  # written by the pool's threads, outside it
            bitmask = allocate_bitmask(len(positions), self.vocab_size)
        self.prepare((p[1], p[2]) for p in positions)
        jobs = []
        for row, (_, request_id, spec, output_ids, proposed) in enumerate(positions):
            job = _Job(request_id, spec, self._requests[request_id], row, list(proposed))
            if not proposed:  # FIFO pool: its compile job was submitted before it
                job.future = self._submit(_sync_and_fill, job.matcher, list(output_ids),
                                          bitmask[row])
            jobs.append(job)
        self._pending = (bitmask, jobs, [p[0] for p in positions])

    def masks(self) -> StepMasks | None:
        """The submitted masks, once filled (positions after proposed tokens are filled
        here, one by one: each tentatively accepts its proposals, then rolls them back)."""
        if self._pending is None:
            return None
        bitmask, jobs, logits_rows = self._pending
        self._pending = None
        for job in jobs:
            if job.future is not None:
                self._check(job, job.future.result())
        for job in jobs:
            if job.future is None and job.request_id not in self.failed:
                self._check(job, _fill_ahead(job.matcher, job.proposed, bitmask[job.row]))
        for job in jobs:
            if job.request_id in self.failed:  # the token drawn there is dropped
                bitmask[job.row] = -1
        return StepMasks(bitmask, logits_rows)

    def _check(self, job: _Job, result: tuple[float, BaseException | None]) -> None:
        elapsed, error = result
        matcher = None if error is not None else job.matcher.result()
        if error is not None:
            self._fail(job.request_id, job.spec, _grammar_failure(error))
        elif matcher.is_error():
            self._fail(job.request_id, job.spec, _grammar_failure(matcher.error()))
        elif elapsed > self.mask_budget_s:
            self._fail(job.request_id, job.spec, (
                f"following the grammar took {elapsed * 1e3:.1f} ms of CPU at output token "
                f"{len(matcher.accepted)}, over the budget of "
                f"{self.mask_budget_s * 1e3:.0f} ms a step (grammar_mask_budget_ms): the "
                "grammar is too ambiguous to follow at this length"))

    def close(self) -> None:
        for pool in (self._compiles, self._pool):
            if pool is not None:
                pool.shutdown(wait=True)


def _sync_and_fill(compiled: concurrent.futures.Future, output_ids: list[int],
                   row: torch.Tensor) -> tuple[float, BaseException | None]:
    """On a pool thread: bring the request's matcher (once compiled) to `output_ids`,
    fill its mask into `row`. Returns the seconds the sync and fill took (the compile is a
    one-time cost, not counted against the step's budget) and the exception raised by any
    of them, if any."""
    try:
        matcher = compiled.result()
    except Exception as exc:  # noqa: BLE001 - its grammar did not compile here
        return 0.0, exc
    t0 = time.thread_time()
    try:
        matcher.sync(output_ids)
        if not matcher.is_error():
            matcher.fill_bitmask(row)
    except Exception as exc:  # noqa: BLE001 - reported for this request alone
        return time.thread_time() - t0, exc
    return time.thread_time() - t0, None


def _fill_ahead(compiled: concurrent.futures.Future, proposed: list[int], row: torch.Tensor
                ) -> tuple[float, BaseException | None]:
    """The mask of the position after `proposed` tokens: accept them tentatively, fill,
    roll back. If an earlier proposal breaks the grammar this position is never reached
    (the masked token before it cannot equal that proposal), and its mask is moot. (The
    request's first position was filled before: its matcher is compiled.)"""
    t0 = time.thread_time()
    try:
        matcher = compiled.result()
        before = len(matcher.accepted)
        if matcher.accept(proposed):
            matcher.fill_bitmask(row)
        matcher.rollback(len(matcher.accepted) - before)
    except Exception as exc:  # noqa: BLE001 - reported for this request alone
        return time.thread_time() - t0, exc
    return time.thread_time() - t0, None


def _grammar_failure(error) -> str:
    """One line saying how a request's grammar failed at run time."""
    from treadle.structured.compiler import parser_limit

    return f"the grammar failed while generating: {parser_limit(str(error))}"
