"""`LazyGrammarCompiler`: the one grammar compiler of the served tokenizer, built once in
a thread (at start by `treadle serve`, else on the first structured request).

Owns only when and where the compiler is built; what a grammar is and how it masks
tokens is treadle/structured/.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

from treadle.engine.client import EngineClient


class LazyGrammarCompiler:
    """The grammar compiler for the served tokenizer, built in a thread (converting a
    49152-id tokenizer takes ~0.3 s, much of it holding the GIL: the engine's thread waits
    meanwhile): at start by `treadle serve` (`warm_up`), before any request, else on first
    use; None without a tokenizer."""

    def __init__(self, engine: EngineClient) -> None:
        self._engine = engine
        self._future: concurrent.futures.Future | None = None
        self._lock = threading.Lock()

    def warm_up(self) -> None:
        """Start building the compiler in a thread now (no-op without a tokenizer)."""
        with self._lock:
            if self._future is None and self._engine.tokenizer is not None:
                from treadle.structured.compiler import GrammarCompiler
                self._future = concurrent.futures.Future()
                engine = self._engine

                def build() -> None:
                    try:
                        compiler = GrammarCompiler.shared(
                            engine.model_dir, engine.tokenizer, engine.limits.vocab_size,
                            engine.eos_token_id)
                        compiler.compile_cpus = engine.step_thread_cpus
                        self._future.set_result(compiler)
                    except BaseException as exc:  # noqa: BLE001 - raised again by get()
                        self._future.set_exception(exc)
                threading.Thread(target=build, name="treadle-grammar-compiler",
                                 daemon=True).start()

    async def get(self):
        self.warm_up()
        if self._future is None:
            return None
        return await asyncio.wrap_future(self._future)

    @property
    def started(self) -> bool:
        """Whether building the compiler has begun (at start, or for a request)."""
        return self._future is not None
