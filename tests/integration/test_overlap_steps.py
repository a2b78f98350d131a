"""`overlap_steps`: the next step runs on the worker's thread while the engine processes
the outputs of the one before (treadle/executor/uni.py, EngineCore._step; docs/overlap.md).

The outputs must be the ones the serial loop gives; a request that ends while a step is
in flight (a stop string, an abort) is dropped from it without harming the others; the
combinations it cannot run are refused at start, by name."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from server_fixtures import TINY_DEMO, running_server, write_tiny_demo
from treadle import LLM, SamplingParams
from treadle.config import EngineConfig
from treadle.models.demo import write_demo_model

PROMPTS = [[1 + (7 * i + j) % 200 for j in range(5 + 9 * i)] for i in range(6)]
"""Six prompts of 5 to 50 tokens."""


@pytest.fixture(scope="module")
def tiny_demo(tmp_path_factory):
    return write_tiny_demo(tmp_path_factory.mktemp("overlap"))


def _generate(model: str, overlap: bool, params):
    """The engine (for the caller to inspect and shut down) and each prompt's tokens."""
    llm = LLM(model=model, dtype="float32", overlap_steps=overlap)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return llm, [o.outputs[0].token_ids for o in outputs]


def test_greedy_outputs_equal_the_serial_loop(tiny_demo):
    """Different lengths end at different steps, so the batch shrinks while steps
    overlap; every token must be the serial loop's."""
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 5 * i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    serial_llm, serial = _generate(tiny_demo, False, params)
    serial_llm.engine.shutdown()
    overlap_llm, overlapped = _generate(tiny_demo, True, params)
    try:
        assert overlapped == serial
        core = overlap_llm.engine
        assert not core.has_unfinished_requests()
        assert core.scheduler.kv.usage == 0.0  # every block back once the last step returned
    finally:
        overlap_llm.engine.shutdown()


def test_steps_run_on_the_worker_thread_and_its_errors_reach_the_caller(tiny_demo):
    llm = LLM(model=tiny_demo, dtype="float32", overlap_steps=True)
    try:
        worker = llm.engine.executor.worker
        run = worker.execute_model
        threads, calls = set(), []

        def recording(scheduler_output):
            threads.add(threading.current_thread().name)
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("kernel fault on step 3")
            return run(scheduler_output)

        worker.execute_model = recording
        with pytest.raises(RuntimeError, match="kernel fault on step 3"):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}],
                         SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        assert threads and all(t.startswith("treadle-worker") for t in threads)
        assert threading.current_thread().name not in threads
    finally:
        llm.engine.shutdown()


def test_a_stop_string_ends_its_request_in_flight_and_leaves_the_others_alone(tmp_path):
    """The stop string is found after the next step was submitted: its row there is
    dropped. Batch-invariant kernels make the other rows independent of that extra row,
    so their tokens must equal the serial loop's bit for bit."""
    model = str(write_demo_model(tmp_path / "m", seed=3, config_overrides=TINY_DEMO))
    probe = LLM(model=model, dtype="bfloat16", batch_invariant=True)
    try:
        first = probe.generate([{"prompt_token_ids": PROMPTS[0]}],
                               SamplingParams(temperature=0.0, max_tokens=12,
                                              ignore_eos=True))[0].outputs[0]
    finally:
        probe.engine.shutdown()
    stop = first.text[len(first.text) // 2:][:3]
    assert stop.strip(), "the probe's text has something to stop on"
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                             stop=[stop] if i == 0 else None) for i in range(len(PROMPTS))]
    results = {}
    for overlap in (False, True):
        llm = LLM(model=model, dtype="bfloat16", batch_invariant=True, overlap_steps=overlap)
        try:
            outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
            results[overlap] = [(o.outputs[0].text, o.outputs[0].token_ids,
                                 o.outputs[0].finish_reason) for o in outputs]
            assert llm.engine.scheduler.kv.usage == 0.0
        finally:
            llm.engine.shutdown()
    assert results[True] == results[False]
    assert results[True][0][2] == "stop" and stop not in results[True][0][0]


def test_served_stream_equals_the_offline_tokens(tiny_demo):
    """The server's door: a streamed greedy completion under --overlap-steps."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm = LLM(model=tiny_demo, dtype="float32")
    try:
        expected = llm.generate([{"prompt_token_ids": PROMPTS[3]}], params)[0].outputs[0].text
    finally:
        llm.engine.shutdown()
    with running_server(tiny_demo, "--overlap-steps") as (base, _):
        text = ""
        with httpx.stream("POST", f"{base}/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": PROMPTS[3], "max_tokens": 16, "temperature": 0,
                "ignore_eos": True, "stream": True}) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        assert text == expected


@pytest.mark.parametrize("options, named", [
    ({"distributed_executor_backend": "mp"}, "distributed_executor_backend mp"),
    ({"pipeline_parallel_size": 2}, "distributed_executor_backend mp"),
])
def test_refused_beside_what_it_cannot_run_with(options, named):
    with pytest.raises(ValueError, match=f"{named} does not support overlap_steps"):
        EngineConfig.from_options(model="demo", overlap_steps=True, **options)
