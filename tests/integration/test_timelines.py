"""The in-memory StepRecorder against the --trace file of the same run: a tiny model, a
tight KV cache and an urgent late arrival, so that requests are chunked, preempted at
admission and for memory (by recompute, or by swap), and finish in different steps.
Every request's timeline must say what the trace says: its prefill chunks and decode
steps (step by step), its tokens, its preemptions (steps and kinds), its finish."""

from __future__ import annotations

import random
import threading

import pytest

from treadle.config import EngineConfig
from treadle.engine.core import EngineCore
from treadle.engine.step_observers import StepObservers
from treadle.engine.timeline import StepRecorder
from treadle.engine.trace import read_trace
from treadle.request import Request
from treadle.sampling_params import SamplingParams

NUM_REQUESTS = 14


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from conftest import make_tiny_checkpoint
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama-timelines"), "llama")


def workload():
    """(arrival step, prompt, max_tokens, priority, tenant) per request."""
    rng = random.Random(11)
    items = []
    for i in range(NUM_REQUESTS):
        prompt = [rng.randrange(3, 512) for _ in range(rng.choice([1, 5, 17, 40, 90]))]
        items.append((i // 2, prompt, rng.randint(6, 24), rng.randint(0, 3),
                      rng.choice(["a", "b"])))
    items.append((NUM_REQUESTS // 2 + 1, [9, 8, 7], 5, -5, "b"))  # urgent: preempts
    return items


def run(model_dir, trace_path, mode: str, max_steps: int = 4096, max_finished: int = 100,
        on_recorder=None):
    config = EngineConfig.from_options(
        model=model_dir, dtype="float32", block_size=4, num_kv_blocks=40,
        max_num_batched_tokens=32, max_num_seqs=4, preemption_mode=mode, swap_space="1MiB",
        scheduling_policy="priority", admission_preemption_threshold=1.0,
        admission_preemption_wait_steps=0,  # preempt at admission: the timelines show it
        # no aging: it reads the wall clock, and on a loaded machine the slower steps
        # changed the order enough that nothing was preempted
        priority_aging_rate=0.0, priority_aging=0.0,
        trace=str(trace_path))
    engine = EngineCore(config)
    recorder = StepRecorder(engine.scheduler, max_steps=max_steps, max_finished=max_finished)
    engine.trace.add(recorder)
    if on_recorder is not None:
        on_recorder(recorder)
    finished_seen = []
    recorder.add_finish_listener(lambda t: finished_seen.append(t.request_id))
    items = workload()
    step = 0
    while step <= items[-1][0] or engine.has_unfinished_requests():
        for i, (arrival, prompt, max_tokens, priority, tenant) in enumerate(items):
            if arrival == step:
                r = Request(str(i), prompt, SamplingParams(max_tokens=max_tokens,
                                                           temperature=0.0, ignore_eos=True),
                            priority=priority, tenant=tenant)
                r.parent_id = f"user-{i}"
                assert engine.add_request(r) is None
        engine.step()
        step += 1
        assert step < 2000
    stats = engine.stats()
    engine.shutdown()
    return recorder, stats, finished_seen


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_every_timeline_matches_the_trace(model_dir, tmp_path, mode):
    path = tmp_path / "run.jsonl"
    recorder, stats, finished_seen = run(model_dir, path, mode)
    trace = read_trace(path)
    items = workload()
    assert stats["num_preemptions"] > 0
    kinds = {"swap": 0, "recompute": 0}
    for rid, arrival in trace.arrivals.items():
        t = recorder.timeline(rid)
        assert t is not None and t["status"] == "finished"
        assert recorder.timelines_of(f"user-{rid}") == [t]
        prompt, max_tokens, priority, tenant = items[int(rid)][1:]
        assert (t["num_prompt_tokens"], t["max_tokens"], t["priority"], t["tenant"]) == (
            len(prompt), max_tokens, priority, tenant)
        assert t["num_output_tokens"] == max_tokens  # ignore_eos: every token generated
        # Step by step: (step, tokens, kind) as the trace has them, rebuilt from chunks.
        from_trace = [(s.step, n, kind) for s in trace.steps
                      for r, n, kind in s.scheduled if r == rid]
        from_timeline = []
        for c in t["chunks"]:
            if c["kind"] == "prefill":
                assert c["num_steps"] == 1
                from_timeline.append((c["first_step"], c["num_tokens"], "prefill"))
            else:  # a run of consecutive decode steps, one token each (no speculation)
                assert c["num_steps"] == c["last_step"] - c["first_step"] + 1 == c["num_tokens"]
                from_timeline += [(s, 1, "decode")
                                  for s in range(c["first_step"], c["last_step"] + 1)]
        assert from_timeline == from_trace, rid
        assert t["num_prefill_chunks"] == sum(1 for x in from_trace if x[2] == "prefill")
        assert t["num_decode_steps"] == sum(1 for x in from_trace if x[2] == "decode")
        assert sum(n for _, n, _ in from_timeline) == trace.tokens_by_request()[rid]
        preempted_at = [s.step for s in trace.steps if rid in s.preempted]
        assert [p["step"] for p in t["preemptions"]] == preempted_at, rid
        for p in t["preemptions"]:
            kinds[p["kind"]] += 1
            # after a preemption the request runs again from a later step
            assert any(c["first_step"] > p["step"] for c in t["chunks"])
        finish_step = next(s.step for s in trace.steps
                           for r, _ in s.finished if r == rid)
        assert t["finish_step"] == finish_step == from_trace[-1][0]
        assert t["first_scheduled_step"] == from_trace[0][0]
        assert t["first_token_step"] in [s for s, _, _ in from_trace]
        if not any(p <= t["first_token_step"] for p in preempted_at):
            computed = 0  # the first token comes from the step that completes the prompt
            for s, n, _ in from_trace:
                computed += n
                if computed >= len(prompt):
                    assert t["first_token_step"] == s, rid
                    break
        assert 0 <= t["queue_wait_s"] <= t["ttft_s"] <= t["e2e_s"]
        assert abs(t["arrival_time"] - (arrival.t + recorder.wall_offset
                                        + _trace_t0(recorder, trace))) < 1e-3
    assert kinds["swap"] == stats["num_preemptions_swap"]
    assert kinds["recompute"] == stats["num_preemptions_recompute"]
    assert (kinds["swap"] > 0) == (mode == "swap")
    assert sorted(finished_seen) == sorted(trace.arrivals)
    # The ring of steps holds the same steps as the trace, in order.
    ring = recorder.steps_after(0)
    assert [(s.step, [(r, n, k) for r, n, k, _ in s.scheduled], [r for r, _, _ in s.preempted])
            for s in ring] == [(s.step, [tuple(x) for x in s.scheduled], s.preempted)
                               for s in trace.steps]
    assert all(s.num_prefill_tokens + s.num_decode_tokens == sum(n for _, n, _, _ in s.scheduled)
               for s in ring)


def _trace_t0(recorder, trace) -> float:
    """The trace's times are seconds since its recorder started; the timeline's are
    monotonic: compare through the first step's start (same clock reading in both)."""
    return recorder.steps_after(0)[0].t_start - trace.steps[0].t_start


def test_memory_is_bounded_and_readers_run_beside_the_engine(model_dir, tmp_path):
    """A ring of 8 steps and 3 finished timelines: the newest kept, the rest dropped (the
    parent index too); a reader thread copying all the time never breaks the run."""
    stop = threading.Event()
    errors = []

    def reader(get):
        while not stop.is_set():
            try:
                rec = get()
                if rec is not None:
                    rec.steps_after(0)
                    rec.samples()
                    for i in range(NUM_REQUESTS + 1):
                        rec.timeline(str(i))
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)

    holder: list = []
    thread = threading.Thread(target=reader, args=(lambda: holder[0] if holder else None,))
    thread.start()
    try:
        recorder, stats, _ = run(model_dir, tmp_path / "t.jsonl", "recompute",
                                 max_steps=8, max_finished=3, on_recorder=holder.append)
    finally:
        stop.set()
        thread.join()
    assert not errors
    ring = recorder.steps_after(0)
    assert len(ring) == 8 and ring[-1].seq == recorder.last_seq
    assert [s.seq for s in recorder.steps_after(recorder.last_seq - 3)] == [
        recorder.last_seq - 2, recorder.last_seq - 1, recorder.last_seq]
    assert recorder.live_counts() == {"live": 0, "finished_kept": 3}
    kept = [str(i) for i in range(NUM_REQUESTS + 1) if recorder.timeline(str(i)) is not None]
    assert len(kept) == 3
    assert sum(1 for i in range(NUM_REQUESTS + 1) if recorder.timelines_of(f"user-{i}")) == 3


def test_a_failing_observer_is_dropped_and_the_others_still_see_every_step():
    class Broken:
        def record_step(self, *args, **kwargs):
            raise RuntimeError("boom")

    class Counting:
        def __init__(self):
            self.steps, self.extra = 0, []

        def record_step(self, step, *args, **kwargs):
            self.steps += 1
            self.extra.append(kwargs)

    counting = Counting()
    observers = StepObservers([Broken(), counting])
    observers.record_scheduled(0, None)  # neither sink has it: nothing happens
    observers.record_step(0, 0.0, 1.0, None, [], swap_bytes=5)  # newer cores pass more
    observers.record_step(1, 1.0, 2.0, None, [])
    assert counting.steps == 2 and counting.extra[0] == {"swap_bytes": 5}
    assert len(observers) == 1
    assert not StepObservers()
