"""The progress watchdog (engine/watchdog.py) as pure bookkeeping: a fake clock and a
sampled step count; the scheduler's state as the stall's log line names it."""

from __future__ import annotations

import logging

import pytest

from treadle.config import CacheConfig, SchedulerConfig
from treadle.core.scheduler import Scheduler
from treadle.engine.watchdog import ProgressWatchdog, describe_scheduler
from treadle.request import Request
from treadle.sampling_params import SamplingParams


class Engine:
    """What the watchdog samples: steps scheduled so far, work queued."""

    def __init__(self) -> None:
        self.steps, self.has_work, self.stalls = 0, False, 0

    def sample(self):
        return self.steps, self.has_work

    def stalled(self):
        self.stalls += 1


def watchdog(engine: Engine, timeout: float = 5.0) -> ProgressWatchdog:
    return ProgressWatchdog(timeout, engine.sample, lambda: "running [r1 (running)]",
                            engine.stalled, clock=lambda: 0.0)


def test_an_idle_engine_never_stalls_however_long_it_idles():
    engine = Engine()
    dog = watchdog(engine)
    for now in range(0, 1000):  # the thread samples about once a second
        assert dog.check(float(now)) is None
    engine.has_work = True  # work arrives after a long idle: the clock starts at the
    assert dog.check(1000.0) is None and dog.check(1004.0) is None  # last idle sample
    assert engine.stalls == 0


def test_a_busy_engine_that_steps_never_stalls():
    engine = Engine()
    engine.has_work = True
    dog = watchdog(engine)
    for now in range(0, 100):
        engine.steps += 1
        assert dog.check(float(now)) is None


def test_work_queued_and_no_step_past_the_timeout_is_one_stall_counted_once(caplog):
    engine = Engine()
    dog = watchdog(engine, timeout=5.0)
    dog.check(0.0)
    engine.has_work = True
    engine.steps += 1
    assert dog.check(1.0) is None  # a step happened
    assert dog.check(6.0) is None  # 5 s quiet: not past the timeout yet
    with caplog.at_level(logging.ERROR, logger="treadle.engine.watchdog"):
        reason = dog.check(6.5)
        assert dog.check(30.0) is not None
    assert reason is not None and "no step for 6 s" in reason and "stall_timeout=5" in reason
    assert "no step for 29 s" in dog.stalled  # the reason follows the stall's length
    assert engine.stalls == 1 and dog.num_stalls == 1  # one stall, counted once
    assert [r.message.count("the scheduler holds: running [r1 (running)]")
            for r in caplog.records] == [1]
    engine.steps += 1  # it steps again: the stall is over
    assert dog.check(31.0) is None and dog.stalled is None
    assert dog.check(36.5) is not None and engine.stalls == 2  # a second one counts again


def test_the_work_draining_ends_a_stall_too():
    engine = Engine()
    engine.has_work = True
    dog = watchdog(engine, timeout=1.0)
    dog.check(0.0)
    assert dog.check(2.0) is not None
    engine.has_work = False  # aborted by its client, say
    assert dog.check(2.5) is None


def test_the_timeout_must_be_positive_and_the_thread_samples_often_enough():
    with pytest.raises(ValueError, match="stall_timeout must be > 0"):
        ProgressWatchdog(0, lambda: (0, False), str)
    assert ProgressWatchdog(0.5, lambda: (0, False), str).interval_s == pytest.approx(0.1)
    assert ProgressWatchdog(600, lambda: (0, False), str).interval_s == 1.0


def test_the_log_line_names_what_the_scheduler_holds():
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=1), CacheConfig(block_size=4),
                          num_kv_blocks=32, max_model_len=256)
    for k in range(3):
        scheduler.add_request(Request(f"req-{k}", [5] * 10, SamplingParams(max_tokens=4),
                                      eos_token_id=2, arrival_time=100.0, priority=k))
    scheduler.schedule()  # one seat: req-0 runs, the others wait
    line = describe_scheduler(scheduler, now=112.0)
    assert "running [req-0 (running, 0/10 tokens, priority 0, 12 s old)]" in line
    assert "waiting [req-1 (waiting, 0/10 tokens, priority 1, 12 s old), req-2" in line
    assert "swapped []" in line and "KV usage" in line and "of 32 blocks" in line
