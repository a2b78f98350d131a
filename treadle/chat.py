"""`treadle chat`: an interactive chat in the terminal with any model.

Owns the read-answer loop: the conversation so far rendered with the model's own chat
template, the answer streamed token by token as the engine produces it, and the
commands (`/reset` clears the history, `/exit` or Ctrl-D leaves, Ctrl-C stops the answer
being written and returns to the prompt). The engine runs in AsyncEngine's thread and its
streams in an event loop on a second thread, so the terminal thread only reads lines and
prints; Ctrl-C never interrupts the engine mid-step, it aborts the request as a client
disconnect does. It holds no engine logic.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
import signal
import sys
import threading
from typing import Any, TextIO

from treadle.sampling_params import SamplingParams

HELP = "commands: /reset clears the conversation, /exit (or Ctrl-D) leaves, " \
       "Ctrl-C stops an answer"
_DONE = object()


class ChatSession:
    """A conversation with one engine; `answer` streams one reply to `out`."""

    def __init__(self, engine, params: SamplingParams, system: str | None = None,
                 out: TextIO = sys.stdout) -> None:
        tokenizer = engine.tokenizer
        if tokenizer is None:
            raise ValueError("treadle chat needs a model with a tokenizer")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use "
                             "`treadle generate` for plain completions")
        self.engine, self.tokenizer, self.params, self.out = engine, tokenizer, params, out
        self.system = system
        self.messages: list[dict[str, str]] = []
        self.reset()
        self._ids = itertools.count()
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever,
                                             name="treadle-chat-loop", daemon=True)
        self._loop_thread.start()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join(5)

    def prompt_token_ids(self) -> list[int]:
        text = self.tokenizer.apply_chat_template(self.messages, tokenize=False,
                                                  add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def _stream(self, request_id: str, token_ids: list[int], pieces: queue.Queue) -> None:
        seen = 0
        try:
            async for output in self.engine.generate(request_id, None, token_ids, self.params):
                if output.error:
                    pieces.put(("error", output.error))
                    return
                text = output.outputs[0].text
                if len(text) > seen:
                    pieces.put(("text", text[seen:]))
                    seen = len(text)
        finally:
            pieces.put(_DONE)

    def answer(self, user_text: str) -> tuple[str, str]:
        """Stream the reply to `user_text`; returns (reply, how it ended: done, stopped,
        error). The reply (partial when stopped) joins the history; an error does not."""
        self.messages.append({"role": "user", "content": user_text})
        # SimpleQueue: a KeyboardInterrupt raised inside queue.Queue.get can leave its lock
        # held, and the stream's next put then blocks forever (a hang seen in CI).
        pieces: queue.SimpleQueue = queue.SimpleQueue()
        future = asyncio.run_coroutine_threadsafe(
            self._stream(f"chat-{next(self._ids)}", self.prompt_token_ids(), pieces), self._loop)
        reply, ending = [], "done"
        stop = threading.Event()
        with _ctrl_c_sets(stop):
            while True:
                if stop.is_set() and ending != "stopped":
                    future.cancel()  # leaving the stream aborts the request in the engine
                    ending = "stopped"
                try:
                    item = pieces.get(timeout=0.1)  # a timeout so that Ctrl-C is seen at once
                except queue.Empty:
                    if future.done() and pieces.empty():  # cancelled before it started
                        break
                    continue
                except KeyboardInterrupt:  # not the main thread: no handler installed
                    stop.set()
                    continue
                if item is _DONE:
                    break
                kind, text = item
                if kind == "error":
                    ending = "error"
                    self.out.write(f"\n[error: {text}]")
                    break
                if ending != "stopped":
                    reply.append(text)
                    self.out.write(text)
                    self.out.flush()
        self.out.write("\n[stopped]\n" if ending == "stopped" else "\n")
        self.out.flush()
        if ending == "error":
            self.messages.pop()
        else:
            self.messages.append({"role": "assistant", "content": "".join(reply)})
        return "".join(reply), ending


@contextlib.contextmanager
def _ctrl_c_sets(event: threading.Event):
    """While an answer streams, Ctrl-C sets `event` instead of raising KeyboardInterrupt
    wherever the terminal thread happens to be (main thread only; elsewhere a no-op)."""
    try:
        previous = signal.signal(signal.SIGINT, lambda *_: event.set())
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def run_chat(engine_options: dict[str, Any], params: SamplingParams, system: str | None = None,
             stdin: TextIO = sys.stdin, out: TextIO = sys.stdout) -> int:
    """The interactive loop until /exit or end of input."""
    from treadle.config import EngineConfig
    from treadle.engine.async_engine import AsyncEngine

    engine = AsyncEngine(EngineConfig.from_options(**engine_options))
    engine.start()
    session = ChatSession(engine, params, system, out)
    interactive = stdin.isatty()
    out.write(f"chatting with {engine.model_name}; {HELP}\n")
    out.flush()
    try:
        while True:
            try:
                out.write("> ")
                out.flush()
                line = stdin.readline()
            except KeyboardInterrupt:
                out.write("\n(Ctrl-D or /exit leaves)\n")
                continue
            if not line:  # Ctrl-D / end of input
                out.write("\n")
                return 0
            text = line.strip()
            if not interactive:
                out.write(text + "\n")  # echo piped input so the transcript reads well
            if not text:
                continue
            if text in ("/exit", "/quit"):
                return 0
            if text == "/reset":
                session.reset()
                out.write("[conversation cleared]\n")
                continue
            if text in ("/help", "/?"):
                out.write(HELP + "\n")
                continue
            session.answer(text)
    finally:
        session.close()
        engine.shutdown()
