"""The Batch API below HTTP, no model: input lines checked with line and field named,
completion windows, the store (tenants, pages, exactly one outcome per line, files that
survive a reopen, finalization), and the runner over a fake line executor (a window of
lines in flight, cancel and expiry cutting lines off at once and keeping the answers,
resumption of what a dead process left)."""

from __future__ import annotations

import asyncio
import io
import json

import pytest

from treadle.batch.config import BatchConfig, window_seconds
from treadle.batch.lines import parse_input
from treadle.batch.runner import BatchRunner, LineResult
from treadle.batch.store import BatchRequestError, BatchStore, StateDirInUse

CHAT = "/v1/chat/completions"


def line(custom_id: str, url: str = CHAT, **body) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": {"messages": [{"role": "user", "content": "hi"}], **body}}
                      ).encode() + b"\n"


# ----- lines and windows -------------------------------------------------------------------

def test_good_lines_parse_in_order_and_blank_lines_are_skipped():
    lines, errors = parse_input([line("a"), b"\n", line("b", max_tokens=3)], (CHAT,), 10)
    assert errors == []
    assert [(x.line_no, x.custom_id) for x in lines] == [(1, "a"), (3, "b")]
    assert json.loads(lines[1].body)["max_tokens"] == 3


@pytest.mark.parametrize("raw, code, param, says", [
    (b"{not json\n", "invalid_json_line", None, "not valid JSON"),
    (b"[1, 2]\n", "invalid_json_line", None, "JSON object"),
    (b'{"custom_id": "x", "method": "POST", "url": "/v1/chat/completions"}\n',
     "missing_required_parameter", "body", "body: required"),
    (line("x", url="/v1/completions"), "invalid_url", "url", "not the batch's endpoint"),
    (b'{"custom_id": "x", "method": "GET", "url": "/v1/chat/completions", "body": {}}\n',
     "invalid_value", "method", "'POST'"),
    (b'{"custom_id": 7, "method": "POST", "url": "/v1/chat/completions", "body": {}}\n',
     "invalid_value", "custom_id", "custom_id"),
    (b'{"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": [],'
     b' "extra": 1}\n', "invalid_request", "extra", "unknown key"),
    (b'\xff\xfe\n', "invalid_json_line", None, "UTF-8"),
])
def test_a_bad_line_is_named_by_number_and_field(raw, code, param, says):
    lines, errors = parse_input([line("a"), raw], (CHAT,), 10)
    assert lines == [] and len(errors) == 1
    error = errors[0]
    assert (error.code, error.param, error.line) == (code, param, 2)
    assert error.message.startswith("line 2: ") and says in error.message


def test_duplicates_emptiness_and_too_many_lines():
    _, errors = parse_input([line("a"), line("b"), line("a")], (CHAT,), 10)
    assert errors[0].code == "duplicate_custom_id" and "line 1" in errors[0].message
    assert parse_input([b"\n"], (CHAT,), 10)[1][0].code == "empty_file"
    _, errors = parse_input([line(str(i)) for i in range(4)], (CHAT,), 3)
    assert errors[0].code == "too_many_requests" and errors[0].line == 4
    assert "batch_max_lines" in errors[0].message


def test_completion_windows():
    assert window_seconds("24h") == 86400
    assert window_seconds("90m") == 5400 and window_seconds("2s") == 2
    for bad in ("24", "0h", "1d", "1.5h", "", "1000h"):
        with pytest.raises(ValueError, match="completion_window"):
            window_seconds(bad)
    with pytest.raises(ValueError, match="batch_max_lines"):
        BatchConfig(batch_max_lines=0)
    assert BatchConfig().window(8) == 16 and BatchConfig(batch_max_concurrent_lines=3).window(8) == 3


# ----- the store ----------------------------------------------------------------------------

def upload(store: BatchStore, tenant: str, *raw: bytes, max_lines: int = 100) -> str:
    return store.add_file(tenant, "in.jsonl", "batch", io.BytesIO(b"".join(raw)), 1 << 20,
                          max_lines)["id"]


def test_tenants_see_only_their_own_files_and_batches(tmp_path):
    store = BatchStore(tmp_path)
    file_a = upload(store, "alpha", line("x"))
    assert store.get_file("beta", file_a) is None and store.file_path("beta", file_a) is None
    assert not store.delete_file("beta", file_a)
    with pytest.raises(BatchRequestError) as caught:
        store.create_batch("beta", None, file_a, CHAT, "24h", 86400, None, 4)
    assert caught.value.status == 404 and caught.value.param == "input_file_id"
    batch = store.create_batch("alpha", None, file_a, CHAT, "24h", 86400, {"k": "v"}, 4)
    assert batch["status"] == "validating" and batch["metadata"] == {"k": "v"}
    assert store.get_batch("beta", batch["id"]) is None
    assert store.cancel_batch("beta", batch["id"]) is None
    assert store.list_batches("beta", None, 10) == ([], False)
    assert store.list_files("beta", None, None, 10, "desc") == ([], False)


def test_pages_limits_and_open_batch_bound(tmp_path):
    store = BatchStore(tmp_path)
    file_id = upload(store, "t", line("x"))
    ids = [store.create_batch("t", None, file_id, CHAT, "24h", 86400, None, 3)["id"]
           for _ in range(3)]
    with pytest.raises(BatchRequestError) as caught:
        store.create_batch("t", None, file_id, CHAT, "24h", 86400, None, 3)
    assert caught.value.status == 429 and "batch_max_open_per_tenant=3" in caught.value.message
    page, more = store.list_batches("t", None, 2)
    assert [b["id"] for b in page] == ids[::-1][:2] and more
    page, more = store.list_batches("t", page[-1]["id"], 2)
    assert [b["id"] for b in page] == [ids[0]] and not more
    with pytest.raises(BatchRequestError, match="after"):
        store.list_batches("t", "batch_nope", 2)
    with pytest.raises(BatchRequestError) as caught:
        upload(store, "t", line("a"), line("b"), max_lines=1)
    assert caught.value.status == 400 and "batch_max_lines" in caught.value.message
    with pytest.raises(BatchRequestError) as caught:
        store.add_file("t", "big", "batch", io.BytesIO(b"x" * 100), 99, 10)
    assert caught.value.status == 413 and "batch_max_file_bytes" in caught.value.message
    assert not list(store.files_dir.glob("*.tmp"))


def test_one_outcome_per_line_and_finalize_again_after_a_crash(tmp_path):
    store = BatchStore(tmp_path)
    file_id = upload(store, "t", line("a"), line("b"), line("c"))
    batch_id = store.create_batch("t", None, file_id, CHAT, "24h", 86400, None, 4)["id"]
    assert store.validate(batch_id, 10) == "in_progress"
    assert store.pending_lines(batch_id) == [1, 2, 3]
    assert store.record_outcome(batch_id, 2, 200, {"custom_id": "b", "n": 1})
    assert not store.record_outcome(batch_id, 2, 200, {"custom_id": "b", "n": 2})
    assert store.record_outcome(batch_id, 1, 400, {"custom_id": "a"})
    assert store.pending_lines(batch_id) == [3]
    assert store.request_counts(batch_id) == {"total": 3, "completed": 1, "failed": 1}
    store.close()
    store = BatchStore(tmp_path)  # what a restart sees
    assert store.pending_lines(batch_id) == [3]
    store.finalize(batch_id, "cancelled")
    batch = store.get_batch("t", batch_id)
    assert batch["status"] == "cancelled" and batch["cancelled_at"] is not None
    output = store.file_path("t", batch["output_file_id"]).read_text().splitlines()
    assert [json.loads(x) for x in output] == [{"custom_id": "b", "n": 1}]
    errors = [json.loads(x) for x in
              store.file_path("t", batch["error_file_id"]).read_text().splitlines()]
    assert [e["custom_id"] for e in errors] == ["a", "c"]
    assert errors[1]["error"]["code"] == "batch_cancelled" and errors[1]["response"] is None
    store.finalize(batch_id, "cancelled")  # already ended: nothing changes
    assert store.get_batch("t", batch_id) == batch


def test_invalid_lines_fail_the_batch_with_their_errors(tmp_path):
    store = BatchStore(tmp_path)
    file_id = upload(store, "t", line("a"), b'{"custom_id": "b"}\n')
    batch_id = store.create_batch("t", None, file_id, CHAT, "24h", 86400, None, 4)["id"]
    assert store.validate(batch_id, 10) == "failed"
    batch = store.get_batch("t", batch_id)
    assert batch["failed_at"] is not None and batch["output_file_id"] is None
    (error,) = batch["errors"]["data"]
    assert error["line"] == 2 and error["param"] == "method"


def test_files_past_their_expiry_are_gone_for_every_reader_then_swept(tmp_path, monkeypatch):
    clock = [1000]
    monkeypatch.setattr("treadle.batch.store._now", lambda: clock[0])
    store = BatchStore(tmp_path)
    kept = upload(store, "t", line("a"))
    short = store.add_file("t", "s.jsonl", "batch", io.BytesIO(line("b")), 1 << 20, 10,
                           expires_s=3600)
    assert short["expires_at"] == 4600 and store.get_file("t", kept)["expires_at"] is None
    batch_id = store.create_batch("t", None, kept, CHAT, "24h", 86400, None, 4,
                                  output_expires_s=7200)["id"]
    clock[0] = 4600
    assert store.get_file("t", short["id"]) is None and store.file_path("t", short["id"]) is None
    assert [f["id"] for f in store.list_files("t", None, None, 10, "asc")[0]] == [kept]
    assert not store.delete_file("t", short["id"])
    with pytest.raises(BatchRequestError) as caught:
        store.create_batch("t", None, short["id"], CHAT, "24h", 86400, None, 4)
    assert caught.value.status == 404
    assert (store.files_dir / short["id"]).exists()
    assert store.sweep_expired() == 1 and not (store.files_dir / short["id"]).exists()
    assert store.validate(batch_id, 10) == "in_progress"
    store.record_outcome(batch_id, 1, 200, {"custom_id": "a"})
    store.finalize(batch_id, "completed")
    output = store.get_file("t", store.get_batch("t", batch_id)["output_file_id"])
    assert output["expires_at"] == 4600 + 7200 and output["purpose"] == "batch_output"


def test_a_second_server_cannot_take_the_state_directory(tmp_path):
    first = BatchStore(tmp_path)
    with pytest.raises(StateDirInUse, match="--state-dir"):
        BatchStore(tmp_path)
    first.close()
    BatchStore(tmp_path).close()


# ----- the runner over a fake executor -------------------------------------------------------

class FakeExecutor:
    """Answers a line once it is let go (all at once unless `hold`), recording what ran and
    what was cut off."""

    def __init__(self, hold: bool = False) -> None:
        self.hold = hold
        self.gates: dict[str, asyncio.Event] = {}
        self.started: list[str] = []
        self.cut_off: list[str] = []
        self.max_in_flight = self.in_flight = 0

    def let_go(self, *custom_ids: str) -> None:
        for custom_id in custom_ids:
            self.gates.setdefault(custom_id, asyncio.Event()).set()

    async def __call__(self, line, owner, cancelled):
        self.started.append(line.custom_id)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        gate = self.gates.setdefault(line.custom_id, asyncio.Event())
        if not self.hold:
            gate.set()
        try:
            done = asyncio.ensure_future(gate.wait())
            stop = asyncio.ensure_future(cancelled.wait())
            await asyncio.wait({done, stop}, return_when=asyncio.FIRST_COMPLETED)
            done.cancel(), stop.cancel()
            if cancelled.is_set():
                self.cut_off.append(line.custom_id)
                return None
            body = json.loads(line.body)
            if body.get("max_tokens") == -1:
                return LineResult(400, {"error": {"param": "max_tokens"}})
            return LineResult(200, {"id": f"cmpl-{line.custom_id}", "owner": owner.tenant})
        finally:
            self.in_flight -= 1


async def until(predicate, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def make_batch(store: BatchStore, n: int, window: str = "24h", **body) -> str:
    file_id = upload(store, "t", *[line(f"c{i}", **body) for i in range(n)])
    return store.create_batch("t", ["m"], file_id, CHAT, window, window_seconds(window),
                              None, 8)["id"]


def test_runner_runs_every_line_once_within_its_window(tmp_path):
    async def main():
        store = BatchStore(tmp_path)
        batch_id = make_batch(store, 7)
        bad = make_batch(store, 2, max_tokens=-1)
        fake = FakeExecutor()
        runner = BatchRunner(store, fake, window=3, max_lines=100)
        runner.start()
        await until(lambda: all(store.get_batch("t", b)["status"] == "completed"
                                for b in (batch_id, bad)))
        await runner.stop()
        return store, batch_id, bad, fake

    store, batch_id, bad, fake = asyncio.run(main())
    assert fake.max_in_flight <= 3 and len(fake.started) == 9
    batch = store.get_batch("t", batch_id)
    assert batch["request_counts"] == {"total": 7, "completed": 7, "failed": 0}
    assert batch["error_file_id"] is None and batch["finalizing_at"] is not None
    out = [json.loads(x) for x in
           store.file_path("t", batch["output_file_id"]).read_text().splitlines()]
    assert [o["custom_id"] for o in out] == [f"c{i}" for i in range(7)]
    assert out[0]["response"] == {"status_code": 200, "request_id": "cmpl-c0",
                                  "body": {"id": "cmpl-c0", "owner": "t"}}
    failed = store.get_batch("t", bad)
    assert failed["request_counts"]["failed"] == 2 and failed["output_file_id"] is None


@pytest.mark.parametrize("how", ["cancel", "expire"])
def test_cancel_or_expiry_cuts_lines_off_at_once_and_keeps_the_answers(tmp_path, how):
    async def main():
        store = BatchStore(tmp_path)
        batch_id = make_batch(store, 6, window="2s" if how == "expire" else "24h")
        fake = FakeExecutor(hold=True)
        now = [0.0]
        runner = BatchRunner(store, fake, window=2, max_lines=100,
                             clock=lambda: store.get_batch("t", batch_id)["created_at"] + now[0])
        runner.start()
        await until(lambda: len(fake.started) == 2)
        fake.let_go("c0", "c1")  # the first two lines answer, the next two are held
        await until(lambda: len(fake.started) == 4)
        assert store.request_counts(batch_id)["completed"] == 2
        if how == "cancel":
            assert store.cancel_batch("t", batch_id)["status"] == "cancelling"
            runner.wake()
        else:
            now[0] = 3.0
        await until(lambda: store.get_batch("t", batch_id)["status"] in ("cancelled", "expired"))
        await runner.stop()
        return store, batch_id, fake

    store, batch_id, fake = asyncio.run(main())
    batch = store.get_batch("t", batch_id)
    assert batch["status"] == ("cancelled" if how == "cancel" else "expired")
    assert sorted(fake.cut_off) == ["c2", "c3"] and len(fake.started) == 4
    out = store.file_path("t", batch["output_file_id"]).read_text().splitlines()
    assert [json.loads(x)["custom_id"] for x in out] == ["c0", "c1"]
    errors = [json.loads(x) for x in
              store.file_path("t", batch["error_file_id"]).read_text().splitlines()]
    code = "batch_cancelled" if how == "cancel" else "batch_expired"
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [
        (f"c{i}", code) for i in range(2, 6)]


def test_runner_resumes_what_a_dead_process_left_and_pauses_without_recording(tmp_path):
    store = BatchStore(tmp_path)
    batch_id = make_batch(store, 5)
    assert store.validate(batch_id, 100) == "in_progress"
    store.record_outcome(batch_id, 1, 200, {"custom_id": "c0", "before": True})
    store.record_outcome(batch_id, 2, 200, {"custom_id": "c1", "before": True})

    async def main():
        fake = FakeExecutor(hold=True)
        paused = [False]
        runner = BatchRunner(store, fake, window=8, max_lines=100, paused=lambda: paused[0])
        runner.start()
        await until(lambda: len(fake.started) == 3)
        paused[0] = True  # shutting down: lines in flight are cut off, none recorded
        await until(lambda: len(fake.cut_off) == 3)
        assert store.request_counts(batch_id)["completed"] == 2
        paused[0] = False
        fake.hold = False
        await until(lambda: store.get_batch("t", batch_id)["status"] == "completed")
        await runner.stop()
        return fake

    fake = asyncio.run(main())
    assert sorted(fake.started) == ["c2", "c2", "c3", "c3", "c4", "c4"]
    batch = store.get_batch("t", batch_id)
    out = [json.loads(x) for x in
           store.file_path("t", batch["output_file_id"]).read_text().splitlines()]
    assert [o["custom_id"] for o in out] == [f"c{i}" for i in range(5)]
    assert [o.get("before", False) for o in out] == [True, True, False, False, False]
