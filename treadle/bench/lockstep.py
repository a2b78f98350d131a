"""Engines taking turns: closed loops of requests on several engines in one process, one
engine step each in turn, each engine timed over its own steps.

On a shared machine two runs of the same engine back to back differed by up to 11%
(docs/benchmarks.md, "Speculative decoding", round 9), which is as large as most changes
one wants to measure; stepping in turn, the machine's drift moves the engines together
instead of into their ratio (0.983-1.003 for two identical engines). Used by `treadle
bench spec` and `python -m treadle.bench.paired`. It measures; nothing here is a target.
"""

from __future__ import annotations

import os
import time
from typing import Any


def _load_average() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


class ClosedLoop:
    """One system's closed loop over every prompt, at most `concurrency` in flight: a new
    request starts as soon as one ends (max_tokens: one limit for all, or one per
    prompt; greedy). `step()` tops the batch up and runs one engine
    step, timed (wall and CPU); output tokens/s counts only this loop's timed steps, so
    loops of several systems can take turns step by step (`run_lockstep`)."""

    def __init__(self, llm, prompts: list[list[int]], max_tokens: int | list[int],
                 concurrency: int, ignore_eos: bool = False) -> None:
        from treadle.sampling_params import SamplingParams

        self.llm, self.concurrency = llm, concurrency
        limits = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
        self.params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=ignore_eos)
                       for n in limits]
        self.pending = list(enumerate(prompts))
        self.in_flight: set[str] = set()
        self.output_tokens = 0
        self.busy_s = self.cpu_s = 0.0
        self.tag = f"b{time.monotonic_ns()}"
        self.stats_before = llm.get_stats()
        self.load_before = _load_average()
        self.start = time.perf_counter()

    @property
    def done(self) -> bool:
        return not (self.pending or self.in_flight)

    def step(self) -> None:
        driver = self.llm.driver
        t0, c0 = time.perf_counter(), time.process_time()
        while self.pending and len(self.in_flight) < self.concurrency:
            i, prompt = self.pending.pop(0)
            rid = f"{self.tag}-{i}"
            assert driver.add(rid, None, prompt, self.params[i], time.monotonic()) is None
            self.in_flight.add(rid)
        outputs = driver.step()
        self.busy_s += time.perf_counter() - t0
        self.cpu_s += time.process_time() - c0
        for out in outputs:
            if out.finished and out.request_id in self.in_flight:
                self.in_flight.discard(out.request_id)
                self.output_tokens += len(out.outputs[0].token_ids)

    def result(self) -> dict:
        after = self.llm.get_stats()
        delta = {k: after[k] - self.stats_before.get(k, 0) for k in after
                 if k.startswith(("spec_num", "time_", "num_steps", "num_preemptions"))}
        drafts = delta.get("spec_num_drafts", 0)
        proposed = delta.get("spec_num_draft_tokens", 0)
        accepted = delta.get("spec_num_accepted_tokens", 0)
        return {"output_tokens": self.output_tokens, "busy_s": self.busy_s,
                "wall_s": time.perf_counter() - self.start, "cpu_s": self.cpu_s,
                "output_tokens_per_s": self.output_tokens / self.busy_s,
                "acceptance_rate": accepted / proposed if proposed else 0.0,
                "mean_accepted_length": 1.0 + accepted / drafts if drafts else 0.0,
                "drafts": drafts, "draft_tokens": proposed, "accepted_tokens": accepted,
                "steps": delta.get("num_steps", 0),
                "forward_s": delta.get("time_forward_s", 0.0),
                "propose_s": delta.get("time_propose_s", 0.0),
                "preemptions": delta.get("num_preemptions", 0),
                "load_average": [self.load_before, _load_average()]}


def run_closed_loop(llm, prompts: list[list[int]], max_tokens: int | list[int],
                    concurrency: int, ignore_eos: bool = False) -> dict:
    """One system's closed loop on its own (see `ClosedLoop`)."""
    loop = ClosedLoop(llm, prompts, max_tokens, concurrency, ignore_eos)
    while not loop.done:
        loop.step()
    return loop.result()


def run_lockstep(llms: dict[str, Any], prompts: list[list[int]], max_tokens: int | list[int],
                 concurrency: int, ignore_eos: bool = False) -> dict[str, dict]:
    """The same closed loop for every system at once, the systems taking one engine step
    each in turn (in the order of `llms`) until all are done. Each system's time is its
    own steps only, and every system's steps sample the same minutes of the machine, so
    the machine's drift, which moves back-to-back runs of one system by 10-25%, moves
    the systems together instead of into their ratios."""
    loops = {name: ClosedLoop(llm, prompts, max_tokens, concurrency, ignore_eos)
             for name, llm in llms.items()}
    while not all(loop.done for loop in loops.values()):
        for loop in loops.values():
            if not loop.done:
                loop.step()
    return {name: loop.result() for name, loop in loops.items()}
