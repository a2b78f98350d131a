"""`treadle chat`: driven through a pseudo-terminal (typed lines, Ctrl-C, Ctrl-D) and
through a pipe, on a tiny model with the demo tokenizer and its ChatML template."""

from __future__ import annotations

import io
import os
import pty
import select
import subprocess
import sys
import time

import pytest

from treadle.models.demo import write_demo_model
from treadle.sampling_params import SamplingParams

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.2,
            eos_token_id=None)  # no EOS: answers run to max_tokens, long enough to interrupt


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return str(write_demo_model(tmp_path_factory.mktemp("chat") / "tiny-chat", seed=4,
                                config_overrides=TINY))


class Terminal:
    """A child process on a pseudo-terminal, read with a deadline."""

    def __init__(self, argv: list[str]) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the pty is its controlling terminal
            os.execvpe(argv[0], argv, {**os.environ, "PYTHONUNBUFFERED": "1"})
        self.screen = ""

    def pump(self, timeout: float) -> None:
        """Add what the child wrote within `timeout` seconds to the screen."""
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if ready:
            try:
                self.screen += os.read(self.fd, 4096).decode("utf-8", "replace")
            except OSError:  # the child closed the terminal
                time.sleep(timeout)

    def read_until(self, text: str, timeout: float = 120.0, start: int = 0) -> int:
        """Read until `text` appears after offset `start`; its offset."""
        deadline = time.monotonic() + timeout
        while (found := self.screen.find(text, start)) < 0:
            if time.monotonic() > deadline:
                raise AssertionError(f"{text!r} did not appear; screen:\n{self.screen[-3000:]}")
            self.pump(0.2)
        return found

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def wait(self, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            self.pump(0.2)
        os.kill(self.pid, 9)
        raise AssertionError("chat did not exit")


def chat_argv(model: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "treadle.cli", "--log-level", "WARNING", "chat", "--model",
            model, "--dtype", "float32", "--num-kv-blocks", "256", *extra]


def test_chat_in_a_terminal_streams_stops_on_ctrl_c_and_leaves_on_ctrl_d(chat_model):
    term = Terminal(chat_argv(chat_model, "--max-tokens", "900"))
    banner = term.read_until("chatting with tiny-chat")
    prompt = term.read_until("> ", start=banner)
    term.send("hello there\r")
    echo = term.read_until("hello there", start=prompt)
    # Tokens stream: text arrives while the 900-token answer is still being written.
    deadline = time.monotonic() + 60
    while len(term.screen) < echo + len("hello there") + 40 and time.monotonic() < deadline:
        term.pump(0.1)
    assert "[stopped]" not in term.screen
    term.send("\x03")  # Ctrl-C: stop this answer, stay in the chat
    stopped = term.read_until("[stopped]", start=echo)
    again = term.read_until("> ", start=stopped)
    term.send("/reset\r")
    cleared = term.read_until("[conversation cleared]", start=again)
    term.read_until("> ", start=cleared)
    term.send("\x04")  # Ctrl-D leaves
    assert term.wait() == 0


def test_chat_through_a_pipe(chat_model):
    script = "hi\n/reset\nsecond question\n/exit\nnot read\n"
    proc = subprocess.run(chat_argv(chat_model, "--max-tokens", "12"), input=script,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.index("> hi\n") < out.index("[conversation cleared]") \
        < out.index("> second question\n") < out.index("> /exit")
    assert "not read" not in out


def test_session_keeps_history_with_the_chat_template_and_reset_clears_it(chat_model):
    from treadle.chat import ChatSession
    from treadle.config import EngineConfig
    from treadle.engine.async_engine import AsyncEngine

    engine = AsyncEngine(EngineConfig.from_options(model=chat_model, dtype="float32",
                                                   num_kv_blocks=128))
    engine.start()
    out = io.StringIO()
    session = ChatSession(engine, SamplingParams(max_tokens=6, temperature=0), system="Be brief.",
                          out=out)
    try:
        first, ending = session.answer("one")
        assert ending == "done" and out.getvalue() == first + "\n"
        session.answer("two")
        assert [m["role"] for m in session.messages] == ["system", "user", "assistant", "user",
                                                         "assistant"]
        expected = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\none<|im_end|>\n"
                    f"<|im_start|>assistant\n{first}<|im_end|>\n")
        assert session.tokenizer.decode(session.prompt_token_ids()).startswith(expected)
        session.reset()
        assert session.messages == [{"role": "system", "content": "Be brief."}]
        assert session.answer("one")[0] == first  # greedy: same history, same answer
    finally:
        session.close()
        engine.shutdown()


INVARIANT_CHAT = dict(TINY, hidden_size=256, intermediate_size=768)
"""head_dim 64 (the decode kernel's vector path) and sums long enough that the default
kernels' orders differ by rows (docs/batch_invariance.md)."""
TURNS = ["Hello, my name is Ada.", "What is my name?", "Tell me a story about it."]


class RecordingEngine:
    """An engine whose streams' last outputs are kept: each answer's token logprobs."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.logprobs: list[list[float]] = []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    async def generate(self, *args, **kwargs):
        last = None
        async for output in self.engine.generate(*args, **kwargs):
            last = output
            yield output
        completion = last.outputs[0]
        self.logprobs.append([step[token].logprob for token, step
                              in zip(completion.token_ids, completion.logprobs)])


def test_chat_answers_as_the_server_under_batch_invariance(tmp_path, monkeypatch):
    """Issue 49, item 7: a three-turn `treadle chat` at temperature 0 (piped input, its
    turn 2 and 3 prompts hitting the prefix cache over what it computed before) and the
    same conversations sent to `/v1/chat/completions` of a fresh server (each turn's
    messages as the chat kept them, all three at once: prefilled, batched together) give
    the same answers, down to the bits of every token's logprob, under batch invariance
    (without it the logprobs part: the random model's answers are too repetitive for its
    near-ties to flip, as SmolLM2's did)."""
    import json
    import threading
    import urllib.request

    from server_fixtures import running_server
    from treadle import chat

    model = str(write_demo_model(tmp_path / "tiny-chat", seed=5,
                                 config_overrides=INVARIANT_CHAT))
    sessions = []

    class Recorded(chat.ChatSession):
        def __init__(self, engine, *args, **kwargs):
            super().__init__(RecordingEngine(engine), *args, **kwargs)
            sessions.append(self)

    monkeypatch.setattr(chat, "ChatSession", Recorded)
    out = io.StringIO()
    status = chat.run_chat(
        dict(model=model, dtype="bfloat16", batch_invariant=True, num_kv_blocks=256),
        SamplingParams(max_tokens=24, temperature=0, logprobs=1), system="Be brief.",
        stdin=io.StringIO("\n".join(TURNS) + "\n/exit\n"), out=out)
    assert status == 0
    session = sessions[0]
    messages = session.messages
    assert [m["role"] for m in messages] == ["system"] + ["user", "assistant"] * 3
    answers = [m["content"] for m in messages[2::2]]
    assert all(answers) and out.getvalue().count("> ") == 4
    assert [len(lp) for lp in session.engine.logprobs] == [24] * 3

    served: dict[int, dict] = {}
    with running_server(model, "--dtype", "bfloat16", "--batch-invariant",
                        "--num-kv-blocks", "256") as (base, _):
        def ask(turn: int) -> None:
            body = {"model": "tiny", "messages": messages[:2 + 2 * turn], "max_tokens": 24,
                    "temperature": 0, "logprobs": True}
            request = urllib.request.Request(f"{base}/v1/chat/completions",
                                             json.dumps(body).encode(),
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=300) as response:
                served[turn] = json.loads(response.read())

        threads = [threading.Thread(target=ask, args=(turn,)) for turn in (2, 1, 0)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    for turn, answer in enumerate(answers):
        choice = served[turn]["choices"][0]
        assert choice["message"]["content"] == answer, f"turn {turn + 1}"
        got = [entry["logprob"] for entry in choice["logprobs"]["content"]]
        assert got == session.engine.logprobs[turn], f"turn {turn + 1}'s logprobs"
    # The same rendering: turn 3's prompt as the server counted it is the chat's own.
    session.messages = messages[:6]
    assert served[2]["usage"]["prompt_tokens"] == len(session.prompt_token_ids())
