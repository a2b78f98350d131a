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
