"""`treadle run-batch`: a batch file answered offline, in input order, each line as the
server answers it (its errors naming the field); stdin and stdout as '-'; a malformed
file refused before any engine loads, naming the line."""

from __future__ import annotations

import io
import json
import sys

import pytest

from treadle import LLM, SamplingParams
from treadle.cli import main
from server_fixtures import write_tiny_demo



@pytest.fixture(scope="module")
def tiny_demo(tmp_path_factory):
    return write_tiny_demo(tmp_path_factory.mktemp("demo"))


def line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


ENGINE = ["--dtype", "float32", "--num-kv-blocks", "256", "--no-progress"]
PROMPT = "The quick brown fox"


def test_run_batch_answers_every_line_in_order_as_the_server_would(tiny_demo, tmp_path,
                                                                   capsys):
    lines = [line("cmpl", "/v1/completions", {"prompt": PROMPT, "max_tokens": 8,
                                              "temperature": 0}),
             line("bad", "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "top_p": 3}),
             line("chat", "/v1/chat/completions", {"messages": [
                 {"role": "user", "content": "hi"}], "max_tokens": 4}),
             line("resp", "/v1/responses", {"input": "hi", "max_output_tokens": 4}),
             line("long", "/v1/completions", {"prompt": PROMPT, "max_tokens": 100000})]
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n")
    assert main(["run-batch", "-i", str(source), "-o", str(target), "--model", tiny_demo,
                 *ENGINE]) == 0
    answers = [json.loads(x) for x in target.read_text().splitlines()]
    assert [a["custom_id"] for a in answers] == ["cmpl", "bad", "chat", "resp", "long"]
    status = {a["custom_id"]: a["response"]["status_code"] for a in answers}
    assert status == {"cmpl": 200, "bad": 400, "chat": 200, "resp": 200, "long": 400}
    errors = {a["custom_id"]: a["response"]["body"]["error"] for a in answers
              if a["response"]["status_code"] != 200}
    assert errors["bad"]["param"] == "top_p"
    assert errors["long"]["param"] == "max_tokens" and "512" in errors["long"]["message"]
    body = answers[0]["response"]["body"]
    assert body["object"] == "text_completion" and answers[0]["response"]["request_id"] == \
        body["id"]
    llm = LLM(tiny_demo, dtype="float32", num_kv_blocks=256)
    (expected,) = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0),
                               use_tqdm=False)
    assert body["choices"][0]["text"] == expected.outputs[0].text
    assert answers[3]["response"]["body"]["object"] == "response"
    assert "5 lines answered (2 with an error)" in capsys.readouterr().err


def test_run_batch_reads_stdin_and_writes_stdout(tiny_demo, monkeypatch):
    data = (line("a", "/v1/completions", {"prompt": "hi", "max_tokens": 2}) + "\n").encode()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    out = io.TextIOWrapper(io.BytesIO())
    monkeypatch.setattr(sys, "stdout", out)
    assert main(["run-batch", "-i", "-", "-o", "-", "--model", tiny_demo, *ENGINE]) == 0
    out.flush()
    (answer,) = [json.loads(x) for x in out.buffer.getvalue().decode().splitlines()]
    assert answer["custom_id"] == "a" and answer["response"]["status_code"] == 200


def test_a_malformed_file_is_refused_naming_its_line(tmp_path, capsys):
    source = tmp_path / "in.jsonl"
    source.write_text(line("a", "/v1/completions", {}) + "\n" +
                      line("a", "/v1/embeddings", {}) + "\n")
    assert main(["run-batch", "-i", str(source), "-o", str(tmp_path / "out"), "--model",
                 "/nowhere"]) == 2
    err = capsys.readouterr().err
    assert "line 2: url: '/v1/embeddings' is not one of /v1/chat/completions" in err
    assert not (tmp_path / "out").exists()
