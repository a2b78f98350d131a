"""The OpenAI Batch API through the official `openai` client on a tiny demo model: files
and batches created, listed page by page, read and cancelled as the client does it;
every endpoint's lines answered exactly as a live call (the same serving object), bad
lines answered with the error naming their field; tenants kept apart; the limits'
errors; a cancel that stops the engine's work at once and keeps the answers; a
completion window that expires a batch with its finished lines kept."""

from __future__ import annotations

import io
import json
import re
import time

import httpx
import openai
import pytest

from server_fixtures import running_server, TINY_DEMO
from treadle.models.demo import write_demo_model

KEYS = {"alpha": "alpha-key", "beta": "beta-key", "gamma": "gamma-key", "delta": "delta-key"}
MAX_LINES, MAX_BYTES, MAX_OPEN, WINDOW = 40, 16_000, 2, 4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = write_demo_model(tmp_path_factory.mktemp("demo") / "m", seed=3,
                             config_overrides=TINY_DEMO)
    keys = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys.write_text("".join(f"- {{key: {k}, tenant: {t}}}\n" for t, k in KEYS.items()
                            if t != "delta") + "- {key: delta-key, tenant: delta, models: [x]}\n")
    with running_server(str(model), "--api-keys-file", str(keys), "--num-kv-blocks", "512",
                        "--batch-max-lines", str(MAX_LINES),
                        "--batch-max-file-bytes", str(MAX_BYTES),
                        "--batch-max-open-per-tenant", str(MAX_OPEN),
                        "--batch-max-concurrent-lines", str(WINDOW)) as (base, _):
        yield base


def client_of(server: str, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key=KEYS[tenant], max_retries=0)


@pytest.fixture
def alpha(server):
    return client_of(server, "alpha")


def jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


def envelope(custom_id: str, url: str, body: dict) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def submit(client: openai.OpenAI, url: str, bodies: list[dict], window: str = "24h",
           **options):
    lines = [envelope(f"req-{i}", url, body) for i, body in enumerate(bodies)]
    upload = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    return client.batches.create(input_file_id=upload.id, endpoint=url,
                                 completion_window=window, metadata={"job": "test"}, **options)


ENDED = ("completed", "failed", "expired", "cancelled")


def wait_for(client: openai.OpenAI, batch_id: str, statuses=ENDED, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.1)


def read_lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


# ----- every endpoint, answered as a live call --------------------------------------------

MESSAGES = [{"role": "user", "content": "Name three colors."}]
GOOD = {
    "/v1/chat/completions": {"model": "tiny", "messages": MESSAGES, "max_tokens": 6,
                             "temperature": 0},
    "/v1/completions": {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 6,
                        "temperature": 0},
    "/v1/responses": {"model": "tiny", "input": "Name three colors.", "max_output_tokens": 6,
                      "temperature": 0},
}


def live_text(client: openai.OpenAI, url: str, body: dict) -> str:
    if url == "/v1/chat/completions":
        return client.chat.completions.create(**body).choices[0].message.content
    if url == "/v1/completions":
        return client.completions.create(**body).choices[0].text
    return client.responses.create(**body).output_text


def answer_text(url: str, body: dict) -> str:
    if url == "/v1/chat/completions":
        return body["choices"][0]["message"]["content"]
    if url == "/v1/completions":
        return body["choices"][0]["text"]
    return body["output"][0]["content"][0]["text"]


@pytest.mark.parametrize("url", sorted(GOOD))
def test_each_endpoint_answers_lines_as_live_calls_and_names_bad_fields(alpha, url):
    good = GOOD[url]
    bodies = [good, {**good, "temperature": 7}, {**good, "frobnicate": 1},
              {**good, "stream": True}, {**good, "model": "no-such-model"}]
    batch = submit(alpha, url, bodies,
                   output_expires_after={"anchor": "created_at", "seconds": 7200})
    assert batch.status == "validating" and batch.endpoint == url
    batch = wait_for(alpha, batch.id)
    assert batch.status == "completed", batch
    assert batch.request_counts.total == 5 and batch.request_counts.completed == 1
    assert batch.request_counts.failed == 4 and batch.metadata == {"job": "test"}
    assert batch.model == "tiny" and batch.errors is None
    assert batch.created_at <= batch.in_progress_at <= batch.finalizing_at <= batch.completed_at
    output = alpha.files.retrieve(batch.output_file_id)
    assert output.purpose == "batch_output" and output.expires_at == output.created_at + 7200
    (ok,) = read_lines(alpha, batch.output_file_id)
    assert ok["custom_id"] == "req-0" and ok["error"] is None
    assert ok["response"]["status_code"] == 200
    assert ok["response"]["request_id"] == ok["response"]["body"]["id"]
    assert answer_text(url, ok["response"]["body"]) == live_text(alpha, url, good)
    errors = {e["custom_id"]: e["response"] for e in read_lines(alpha, batch.error_file_id)}
    assert sorted(errors) == ["req-1", "req-2", "req-3", "req-4"]
    expected = {"req-1": (400, "temperature"), "req-2": (400, "frobnicate"),
                "req-3": (400, "stream"), "req-4": (404, "model")}
    for custom_id, (status, param) in expected.items():
        assert errors[custom_id]["status_code"] == status
        assert errors[custom_id]["body"]["error"]["param"] == param
    live = httpx.post(alpha.base_url.join(url.removeprefix("/v1/")).__str__(),
                      headers={"Authorization": "Bearer alpha-key"}, json=bodies[1])
    assert live.status_code == 400 and live.json() == errors["req-1"]["body"]


def test_a_malformed_file_fails_the_batch_naming_line_and_field(alpha):
    url = "/v1/completions"
    raw = jsonl([envelope("a", url, GOOD[url]), envelope("b", "/v1/chat/completions", {})]) \
        + b'{"custom_id": "c", "method": "POST", "url": "/v1/completions"}\n'
    upload = alpha.files.create(file=("bad.jsonl", io.BytesIO(raw)), purpose="batch")
    batch = alpha.batches.create(input_file_id=upload.id, endpoint=url, completion_window="24h",
                                 output_expires_after={"anchor": "created_at", "seconds": 7200})
    batch = wait_for(alpha, batch.id)
    assert batch.status == "failed" and batch.failed_at is not None
    assert [(e.line, e.param, e.code) for e in batch.errors.data] == [
        (2, "url", "invalid_url"), (3, "body", "missing_required_parameter")]
    assert batch.output_file_id is None and batch.error_file_id is None


# ----- files, pages, tenants ------------------------------------------------------------------

def test_files_and_batches_page_and_belong_to_their_tenant(server, alpha):
    beta = client_of(server, "beta")
    uploads = [beta.files.create(file=(f"f{i}.jsonl", io.BytesIO(jsonl([envelope(
        "x", "/v1/completions", GOOD["/v1/completions"])]))), purpose="batch")
        for i in range(3)]
    page = beta.files.list(limit=2, order="asc")
    assert [f.id for f in page.data] == [u.id for u in uploads[:2]] and page.has_more
    assert [f.id for f in beta.files.list(order="asc")] == [u.id for u in uploads]
    assert beta.files.retrieve(uploads[0].id).filename == "f0.jsonl"
    assert beta.files.content(uploads[0].id).read() == jsonl([envelope(
        "x", "/v1/completions", GOOD["/v1/completions"])])
    batches = [beta.batches.create(input_file_id=u.id, endpoint="/v1/completions",
                                   completion_window="24h") for u in uploads[:2]]
    listed = list(beta.batches.list(limit=1))  # the client follows `after` page by page
    assert [b.id for b in listed] == [b.id for b in batches[::-1]]
    for batch in batches:
        wait_for(beta, batch.id)
    # alpha sees none of it, and cannot read, cancel or delete it
    assert all(b.id not in {x.id for x in batches} for b in alpha.batches.list())
    assert all(f.id not in {u.id for u in uploads} for f in alpha.files.list())
    for call in (lambda: alpha.files.retrieve(uploads[0].id),
                 lambda: alpha.files.content(uploads[0].id),
                 lambda: alpha.files.delete(uploads[0].id),
                 lambda: alpha.batches.retrieve(batches[0].id),
                 lambda: alpha.batches.cancel(batches[0].id)):
        with pytest.raises(openai.NotFoundError):
            call()
    expiring = beta.files.create(file=("e.jsonl", io.BytesIO(b"{}\n")), purpose="batch",
                                 expires_after={"anchor": "created_at", "seconds": 3600})
    assert expiring.expires_at == expiring.created_at + 3600
    with pytest.raises(openai.BadRequestError) as caught:
        beta.files.create(file=("e.jsonl", io.BytesIO(b"{}\n")), purpose="batch",
                          expires_after={"anchor": "created_at", "seconds": 60})
    assert caught.value.body["param"] == "expires_after[seconds]"
    assert beta.files.delete(uploads[2].id).deleted
    with pytest.raises(openai.NotFoundError):
        beta.files.retrieve(uploads[2].id)
    with pytest.raises(openai.ConflictError, match="completed"):
        beta.batches.cancel(batches[0].id)


def test_a_key_limited_to_other_models_has_its_lines_refused_as_live(server):
    delta = client_of(server, "delta")
    url = "/v1/completions"
    batch = wait_for(delta, submit(delta, url, [GOOD[url]]).id)
    (answer,) = read_lines(delta, batch.error_file_id)
    assert answer["response"]["status_code"] == 404
    assert answer["response"]["body"]["error"]["param"] == "model"


def test_limits_answer_with_the_bound_they_hit(server):
    gamma = client_of(server, "gamma")
    url = "/v1/completions"
    many = jsonl([envelope(f"l{i}", url, GOOD[url]) for i in range(MAX_LINES + 1)])
    with pytest.raises(openai.BadRequestError, match="batch_max_lines"):
        gamma.files.create(file=("many.jsonl", io.BytesIO(many)), purpose="batch")
    with pytest.raises(openai.APIStatusError, match="batch_max_file_bytes") as caught:
        gamma.files.create(file=("big.jsonl", io.BytesIO(b"x" * (MAX_BYTES + 1))),
                           purpose="batch")
    assert caught.value.status_code == 413
    with pytest.raises(openai.BadRequestError, match="purpose"):
        gamma.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        gamma.batches.create(input_file_id="file-x", endpoint=url, completion_window="1d")
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        gamma.batches.create(input_file_id="file-x", endpoint="/v1/embeddings",
                             completion_window="24h")
    slow = {**GOOD[url], "max_tokens": 400, "ignore_eos": True}
    open_ones = [submit(gamma, url, [slow] * 3) for _ in range(MAX_OPEN)]
    with pytest.raises(openai.RateLimitError, match="batch_max_open_per_tenant"):
        submit(gamma, url, [slow])
    for batch in open_ones:
        assert gamma.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    for batch in open_ones:
        assert wait_for(gamma, batch.id).status == "cancelled"
    submit(gamma, url, [GOOD[url]])  # room again


# ----- cancel and expiry ------------------------------------------------------------------------

def metric(server: str, name: str) -> float:
    """A treadle metric's value on /metrics, summed over its label sets (present, or
    the test fails)."""
    text = httpx.get(server + "/metrics").text
    values = re.findall(rf"^treadle:{name}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert values, f"treadle:{name} is not on /metrics"
    return sum(float(v) for v in values)


def engine_gauges(server: str) -> tuple[float, float]:
    return metric(server, "num_requests_running"), metric(server, "num_requests_waiting")


def generated_tokens(server: str) -> float:
    return metric(server, "generation_tokens_total")


def short_then_long(url: str, num_long: int) -> list[dict]:
    long = {**GOOD[url], "max_tokens": 480, "ignore_eos": True}
    return [GOOD[url], GOOD[url]] + [long] * num_long


def test_cancel_stops_the_lines_in_flight_at_once_and_keeps_the_answers(server, alpha):
    url = "/v1/completions"
    tokens_before = generated_tokens(server)
    batch = submit(alpha, url, short_then_long(url, 6))
    deadline = time.monotonic() + 60
    while alpha.batches.retrieve(batch.id).request_counts.completed < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert engine_gauges(server)[0] > 0  # long lines are running
    started = time.monotonic()
    assert alpha.batches.cancel(batch.id).status == "cancelling"
    batch = wait_for(alpha, batch.id)
    assert batch.status == "cancelled" and time.monotonic() - started < 5
    assert batch.cancelling_at <= batch.cancelled_at
    # Aborted in the engine, not left to run. The engine thread takes the aborts between
    # its steps, so under load its gauges may fall a step after the batch says cancelled
    # (the test read them at once: a race; a local run under load once failed this test,
    # its message not kept); the long lines' 6 x 480 tokens are never all made.
    deadline = time.monotonic() + 5
    while engine_gauges(server) != (0.0, 0.0):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    made = generated_tokens(server) - tokens_before
    assert 0 < made < 6 * 480, made
    assert [x["custom_id"] for x in read_lines(alpha, batch.output_file_id)] == ["req-0",
                                                                               "req-1"]
    errors = read_lines(alpha, batch.error_file_id)
    assert [e["custom_id"] for e in errors] == [f"req-{i}" for i in range(2, 8)]
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}


def test_a_batch_past_its_window_expires_with_its_finished_lines(alpha):
    url = "/v1/completions"
    batch = submit(alpha, url, short_then_long(url, MAX_LINES - 2), window="2s")
    batch = wait_for(alpha, batch.id, timeout=60)
    assert batch.status == "expired" and batch.expired_at >= batch.expires_at
    done = read_lines(alpha, batch.output_file_id)
    errors = read_lines(alpha, batch.error_file_id)
    # Every line once, answered or expired. Not in submission order: lines start in
    # parallel and one the server turns away for now runs again later (a CI run once
    # finished req-2 before req-1), so which lines made the window is not fixed.
    ids = sorted(x["custom_id"] for x in done + errors)
    assert ids == sorted(f"req-{i}" for i in range(MAX_LINES))
    assert done and all(x["response"]["status_code"] == 200 for x in done)
    assert len(errors) > 0 and {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert batch.request_counts.completed == len(done)
