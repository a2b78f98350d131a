"""`treadle run-batch`: a batch file answered offline, through the serving object, no HTTP.

Owns the offline run: the file's lines checked as the Batch API checks them
(treadle/batch/lines.py; each line's url may be any endpoint a batch may target), an
in-process engine with the offline step budget that `LLM` uses, the server's serving
object over it (server/serving.py, so every line is validated and answered exactly as
`treadle serve` would: server/batch_lines.py), at most `window` lines in flight, a
progress bar, and the answers written in input order as they become ready, each in the
output-file format of the Batch API (`custom_id`, `response` {status_code, request_id,
body}). Per-line errors are answers too (in the same file, as vLLM's run-batch writes
them); a malformed file is refused before the engine loads. Why not `LLM.generate`: the
validation, chat templates, tools, grammars and response bodies all live in the serving
object, which drives an EngineClient; AsyncEngine is that client over the same
EngineDriver that `LLM` steps.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from contextlib import contextmanager
from typing import BinaryIO, Iterator

from tqdm.auto import tqdm

from treadle.batch.lines import InputLine, output_line, parse_input
from treadle.batch.runner import LineResult, Owner
from treadle.server.batch_lines import BATCH_ENDPOINTS, ServingLineExecutor

OFFLINE_OWNER = Owner("default")
"""Offline lines run as the open server's tenant."""
NO_LINE_LIMIT = 10**9


class BatchFileError(ValueError):
    """The input file is not a batch file (its lines' errors, each naming line and field)."""


def read_lines(source: BinaryIO) -> list[InputLine]:
    """The checked lines of a batch file; BatchFileError listing what is wrong."""
    lines, errors = parse_input(source, tuple(BATCH_ENDPOINTS), NO_LINE_LIMIT)
    if errors:
        raise BatchFileError("the input is not a batch file:\n  " +
                             "\n  ".join(e.message for e in errors))
    return lines


@contextmanager
def _opened(path: str, mode: str) -> Iterator:
    if path == "-":
        yield sys.stdin.buffer if "r" in mode else sys.stdout.buffer
        return
    with open(path, mode) as handle:
        yield handle


class _InOrder:
    """Answers written in input order as soon as every earlier one is written."""

    def __init__(self, out: BinaryIO, lines: list[InputLine]) -> None:
        self.out, self.lines = out, lines
        self.ready: dict[int, dict] = {}
        self.next = 0

    def put(self, index: int, answer: dict) -> None:
        self.ready[index] = answer
        while self.next in self.ready:
            self.out.write(json.dumps(self.ready.pop(self.next)).encode() + b"\n")
            self.next += 1
        self.out.flush()


async def answer_lines(serving, lines: list[InputLine], out: BinaryIO, window: int,
                       progress: bool = True) -> dict:
    """Run every line through the serving object, `window` at a time; write each answer
    in input order. Returns {statuses: answers per HTTP status, output_tokens, seconds}."""
    execute = ServingLineExecutor(serving)
    writer = _InOrder(out, lines)
    statuses: dict[int, int] = {}
    slots = asyncio.Semaphore(window)
    never = asyncio.Event()
    bar = tqdm(total=len(lines), desc="Batch lines", unit="line", disable=not progress,
               dynamic_ncols=True)
    tokens, start = 0, time.perf_counter()

    async def one(index: int, line: InputLine) -> None:
        nonlocal tokens
        async with slots:
            result: LineResult | None = await execute(line, OFFLINE_OWNER, never)
        if result is None or (result.status_code == 503 and not serving.engine.is_alive):
            raise RuntimeError(f"the engine stopped while line {line.line_no} ran: "
                               f"{serving.engine.error}")
        statuses[result.status_code] = statuses.get(result.status_code, 0) + 1
        usage = result.body.get("usage") or {}
        tokens += usage.get("completion_tokens", usage.get("output_tokens", 0)) or 0
        writer.put(index, output_line(line.custom_id, result.status_code, result.body))
        bar.update(1)
        bar.set_postfix_str(f"{tokens / max(time.perf_counter() - start, 1e-9):.1f} out tok/s",
                            refresh=False)

    try:
        await asyncio.gather(*(one(i, line) for i, line in enumerate(lines)))
    finally:
        bar.close()
    return {"statuses": statuses, "output_tokens": tokens,
            "seconds": time.perf_counter() - start}


def run_batch(engine_config, server_config, input_path: str, output_path: str,
              lora_modules: list[tuple[str, str]] = (), progress: bool = True) -> dict:
    """Answer the batch file at `input_path` ('-': stdin) into `output_path` ('-':
    stdout) on an in-process engine; what `answer_lines` returns."""
    from treadle.engine.async_engine import AsyncEngine
    from treadle.server.auth import KeyRing
    from treadle.server.serving import OpenAIServing

    with _opened(input_path, "rb") as source:
        lines = read_lines(source)
    engine = AsyncEngine(engine_config, server_config.served_model_name)
    try:
        for name, path in lora_modules:
            engine.add_lora(name, path)
        engine.start()
        serving = OpenAIServing(engine, server_config, KeyRing({}))
        window = 2 * engine_config.scheduler.max_num_seqs
        with _opened(output_path, "wb") as out:
            return asyncio.run(answer_lines(serving, lines, out, window, progress))
    finally:
        engine.shutdown()
