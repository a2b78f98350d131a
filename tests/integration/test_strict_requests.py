"""Strict, cheap refusals (the trust report): bodies that are not RFC 8259 JSON, token ids
outside the vocabulary, mixed prompt lists, texts too long to tokenize, /tokenize under
every route's rules, oversized heads, bodies that stop arriving, bounded echoes, and no
file-system path in /v1/models. Each case was answered 200 (or hung, or reset) before."""

from __future__ import annotations

import json
import re
import socket
import time

import httpx
import pytest

from server_fixtures import running_server
from treadle.models.demo import write_demo_model

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2)
JSON = {"Content-Type": "application/json"}
KEY = {"Authorization": "Bearer alpha-key"}
RESTRICTED = {"Authorization": "Bearer other-key"}  # may use model "elsewhere" only
BODY = b'{"model":"tiny","prompt":"hi","max_tokens":2}'


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("strict")
    model = write_demo_model(root / "m", seed=5, config_overrides=TINY)
    keys = root / "keys.yaml"
    keys.write_text("- {key: alpha-key, tenant: alpha}\n"
                    "- {key: other-key, tenant: other, models: [elsewhere]}\n")
    with running_server(str(model), "--num-kv-blocks", "128", "--api-keys-file", str(keys),
                        "--body-read-timeout-s", "1.5", "--max-header-bytes", "16384") as (base, _):
        yield base


def post(server, path, data: bytes, headers=None):
    return httpx.post(server + path, content=data, headers={**JSON, **KEY, **(headers or {})},
                      timeout=60)


@pytest.mark.parametrize("data, words", [
    (b"\xef\xbb\xbf" + BODY, "UTF-8 byte-order mark"),
    (BODY.decode().encode("utf-16"), "UTF-16 or UTF-32 byte-order mark"),
    (BODY.decode().encode("utf-16-le"), "looks like UTF-16 or UTF-32"),
    (b"\xff" + BODY, "not UTF-8"),
    (BODY[:-1] + b',"temperature":NaN}', "NaN is not a JSON value"),
    (BODY[:-1] + b',"top_p":-Infinity}', "Infinity is not a JSON value"),
    (BODY[:-1] + b',"seed":' + b"9" * 400 + b"}", "a number of 400 characters"),
    (BODY[:-1] + b',"temperature":1e400}', "out of range"),
])
def test_bodies_that_are_not_rfc_8259_json_are_400_naming_the_problem(server, data, words):
    for path in ("/v1/completions", "/tokenize"):
        r = post(server, path, data)
        assert r.status_code == 400, (path, r.text)
        assert words in r.json()["error"]["message"]


def test_token_ids_and_prompt_lists(server):
    r = post(server, "/v1/completions", BODY[:-1] + b',"stop_token_ids":[99999999]}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids"
    assert "outside the vocabulary" in r.json()["error"]["message"]
    r = post(server, "/v1/completions", b'{"model":"tiny","prompt":["hi", 5],"max_tokens":2}')
    assert r.status_code == 400 and "mixes a string and a token id" in r.text
    r = post(server, "/v1/completions", b'{"model":"tiny","prompt":"12345","max_tokens":2}')
    assert r.status_code == 200  # a string of digits is text, as OpenAI reads it


def test_texts_too_long_to_fit_are_refused_before_tokenizing(server):
    text = "hello " * 200_000  # 1.2 MB: tokenized in full before (seconds of CPU)
    for path, body in (("/v1/completions", {"model": "tiny", "prompt": text, "max_tokens": 2}),
                       ("/tokenize", {"prompt": text}),
                       ("/v1/chat/completions", {"model": "tiny", "max_tokens": 2,
                                                 "messages": [{"role": "user",
                                                               "content": text}]})):
        t0 = time.monotonic()
        r = post(server, path, json.dumps(body).encode())
        assert r.status_code == 400, (path, r.text[:200])
        assert "more than the model's context length" in r.json()["error"]["message"]
        assert time.monotonic() - t0 < 2.0


def test_tokenize_follows_every_routes_rules(server):
    r = post(server, "/tokenize", b'{"prompt":"hi","frobnicate":1}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "frobnicate"
    r = post(server, "/detokenize", b'{"tokens":[5],"frobnicate":1}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "frobnicate"
    r = post(server, "/tokenize", b'{"prompt":"hi"}', RESTRICTED)  # not this key's model
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert post(server, "/tokenize", b'{"prompt":"hi"}').status_code == 200


def test_echoes_are_bounded_and_models_show_no_paths(server):
    r = httpx.get(server + "/v1/responses/" + "x" * 10_000, headers=KEY, timeout=30)
    assert r.status_code == 404 and len(r.content) < 500
    card = httpx.get(server + "/v1/models", headers=KEY).json()["data"][0]
    assert card["root"] == card["id"] == "tiny"
    assert "/" not in json.dumps(card)


def raw_request(server, data: bytes, timeout: float) -> bytes:
    """The whole reply: read until the server closes the connection or the body its
    Content-Length announces has arrived (head and body may come in two segments)."""
    host, port = server.rsplit("//", 1)[1].split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(data)
        reply = b""
        while True:
            chunk = s.recv(65536)
            reply += chunk
            head, sep, body = reply.partition(b"\r\n\r\n")
            length = re.search(rb"(?i)content-length: *(\d+)", head) if sep else None
            if not chunk or (length and len(body) >= int(length.group(1))):
                return reply


def test_an_oversized_head_is_431_and_a_stalled_body_408(server):
    reply = raw_request(server, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000
                        + b"\r\n\r\n", timeout=10)
    assert reply.startswith(b"HTTP/1.1 431") and b"max_header_bytes" in reply
    t0 = time.monotonic()
    reply = raw_request(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                        b"Authorization: Bearer alpha-key\r\nContent-Type: application/json\r\n"
                        b"Content-Length: 100\r\n\r\n{\"a\":", timeout=10)
    assert reply.startswith(b"HTTP/1.1 408") and b"body_read_timeout_s" in reply
    assert time.monotonic() - t0 < 5
    assert httpx.get(server + "/health").status_code == 200
