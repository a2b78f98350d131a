"""A server killed with SIGKILL in the middle of a batch, started again on the same state
directory, answers every line exactly once: none lost, none twice (docs/batch.md,
"Durability")."""

from __future__ import annotations

import io
import json
import os
import signal
import sqlite3
import time

import openai
import pytest

from server_fixtures import running_server, TINY_DEMO
from treadle.models.demo import write_demo_model

N = 40


@pytest.fixture(scope="module")
def tiny_demo(tmp_path_factory):
    return str(write_demo_model(tmp_path_factory.mktemp("demo") / "m", seed=7,
                                config_overrides=TINY_DEMO))


def outcomes(state) -> list[tuple[int, str]]:
    with sqlite3.connect(state / "batch.sqlite3") as db:
        return [(n, json.loads(r)["custom_id"]) for n, r in
                db.execute("SELECT line_no, result FROM outcomes ORDER BY line_no")]


def test_sigkill_mid_batch_then_restart_answers_every_line_exactly_once(tiny_demo, tmp_path):
    state = tmp_path / "state"
    serve = ("--state-dir", str(state), "--batch-max-concurrent-lines", "4")
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "tiny", "prompt": f"count {i}", "max_tokens": 48,
                       "ignore_eos": True, "temperature": 0}} for i in range(N)]
    with running_server(tiny_demo, *serve) as (base, proc):
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        upload = client.files.create(file=("in.jsonl", io.BytesIO(
            "".join(json.dumps(x) + "\n" for x in lines).encode())), purpose="batch")
        batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                      completion_window="24h")
        deadline = time.monotonic() + 120
        while client.batches.retrieve(batch.id).request_counts.completed < 4:
            assert time.monotonic() < deadline, "the batch never started"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    before = outcomes(state)
    assert 4 <= len(before) < N, "killed mid-batch: some lines answered, some not"

    with running_server(tiny_demo, *serve) as (base, _):
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        deadline = time.monotonic() + 300
        while (batch := client.batches.retrieve(batch.id)).status != "completed":
            # finalizing: the last line is answered and the output file is being written
            assert batch.status in ("in_progress", "finalizing"), batch
            assert time.monotonic() < deadline, batch
            time.sleep(0.1)
        output = client.files.content(batch.output_file_id).text.splitlines()
        assert batch.error_file_id is None
        assert batch.request_counts.completed == N and batch.request_counts.failed == 0

    answers = [json.loads(x) for x in output]
    assert len(answers) == N
    assert sorted(a["custom_id"] for a in answers) == sorted(f"line-{i}" for i in range(N))
    assert all(a["response"]["status_code"] == 200 for a in answers)
    assert all(len(a["response"]["body"]["choices"][0]["text"]) > 0 for a in answers)
    after = outcomes(state)
    assert [c for _, c in after] == [f"line-{i}" for i in range(N)]  # one per line
    assert set(before) <= set(after)  # what was committed before the kill was kept
    kept = {json.loads(x)["custom_id"]: x for x in output}
    with sqlite3.connect(state / "batch.sqlite3") as db:
        stored = {json.loads(r)["custom_id"]: r for (r,) in db.execute("SELECT result FROM "
                                                                       "outcomes")}
    assert {k: json.loads(v) for k, v in kept.items()} == {
        k: json.loads(v) for k, v in stored.items()}  # the output file is the table
