"""OpenAI response bodies and server-sent-event chunks from the engine's RequestOutputs.

Owns the shapes of the API's answers: completions and chat completions, whole or as
streamed deltas (each chunk carries only the text and tokens that are new since the
previous one), usage (with prompt_tokens_details.cached_tokens), and logprobs in each
endpoint's format. A completions request may hold several prompts: choice `index` is
prompt_index * n + sample_index, as OpenAI numbers them, and their chunks interleave as
outputs arrive. `echo` puts the prompt (and its logprobs, the first one null) before
the completion; `text_offset` values run through the whole choice text, across chunks.
Chat choices may carry tool calls (server/tool_calls.py parses them). vLLM's
`return_token_ids` adds `prompt_token_ids` (completions: per choice; chat: on the body,
or the first chunk) and each choice's `token_ids` (streamed: the new ids of each chunk).
Pure formatting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator

from treadle.server.protocol import now
from treadle.server.tool_calls import ToolCallStreamer, ToolSetup, parse_choice


@dataclass
class Formatting:
    """How one request's outputs are shown."""

    tokenizer: Any
    top_n: int = 0
    """Alternatives per token in logprobs."""
    n: int = 1
    """Samples per prompt (for choice indices)."""
    echo: bool = False
    """Completions: the prompt (and, with logprobs, its logprobs) before the completion."""
    prompt_logprobs: int | None = None
    """vLLM's prompt_logprobs: each choice carries its prompt's logprobs in vLLM's shape."""
    tools: ToolSetup | None = None
    """Chat: parse tool calls out of each choice (None or choice 'none': plain text)."""
    return_token_ids: bool = False
    """vLLM's: prompt_token_ids and each choice's token_ids (streamed: the prompt's once,
    then each chunk's new ids)."""


def usage_of(outputs) -> dict[str, Any]:
    """Usage of one RequestOutput or of a batch of them."""
    outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    cached = sum(getattr(o, "num_cached_tokens", 0) for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _token_text(tokenizer, token_id: int, entry) -> str:
    text = getattr(entry, "decoded_token", None)
    if text is None and tokenizer is not None:
        text = tokenizer.decode([token_id])
    return text if text is not None else str(token_id)


def _top(entries: dict, top_n: int) -> list:
    """The top_n (token id, entry) pairs by rank; the chosen token is among the entries
    even when it ranks lower, and is then left out here."""
    return sorted(entries.items(), key=lambda kv: kv[1].rank)[:top_n]


def prompt_text(output, tokenizer) -> str:
    if output.prompt is not None:
        return output.prompt
    return tokenizer.decode(output.prompt_token_ids) if tokenizer is not None else ""


class _Offsets:
    """Running text_offset of one choice."""

    def __init__(self) -> None:
        self.offset = 0

    def lists(self, token_ids, entries_list, tokenizer, top_n: int, first_null: bool = False):
        tokens, token_logprobs, top, offsets = [], [], [], []
        for k, (token_id, entries) in enumerate(zip(token_ids, entries_list)):
            if entries is None:  # the first prompt token: nothing predicts it
                text = tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)
                tokens.append(text)
                token_logprobs.append(None)
                top.append(None)
            else:
                chosen = entries.get(token_id)
                text = _token_text(tokenizer, token_id, chosen)
                tokens.append(text)
                token_logprobs.append(chosen.logprob if chosen is not None else None)
                top.append({_token_text(tokenizer, t, e): e.logprob
                            for t, e in _top(entries, top_n)})
            offsets.append(self.offset)
            self.offset += len(text)
        return tokens, token_logprobs, top, offsets


def _completion_logprobs(choice, tokenizer, top_n: int, offsets: _Offsets, start: int = 0,
                         prompt_part: tuple | None = None) -> dict | None:
    """{tokens, token_logprobs, top_logprobs, text_offset} for generated tokens [start:],
    after the prompt's (`prompt_part`: (token ids, logprob dicts)) when echoing."""
    if choice.logprobs is None:
        return None
    lists = ([], [], [], [])
    if prompt_part is not None:
        for acc, part in zip(lists, offsets.lists(*prompt_part, tokenizer, top_n)):
            acc.extend(part)
    generated = offsets.lists(choice.token_ids[start:], choice.logprobs[start:], tokenizer,
                              top_n)
    for acc, part in zip(lists, generated):
        acc.extend(part)
    return {"tokens": lists[0], "token_logprobs": lists[1], "top_logprobs": lists[2],
            "text_offset": lists[3]}


def _vllm_prompt_logprobs(output) -> list | None:
    """vLLM's shape: per prompt token None (the first) or {id: {logprob, rank,
    decoded_token}}."""
    if output.prompt_logprobs is None:
        return None
    return [None if entries is None else {
        str(t): {"logprob": e.logprob, "rank": e.rank, "decoded_token": e.decoded_token}
        for t, e in entries.items()} for entries in output.prompt_logprobs]


def _chat_logprobs(choice, tokenizer, top_n: int, start: int = 0) -> dict | None:
    """{content: [{token, logprob, bytes, top_logprobs}]} for generated tokens [start:]."""
    if choice.logprobs is None:
        return None
    content = []
    for token_id, entries in zip(choice.token_ids[start:], choice.logprobs[start:]):
        chosen = entries.get(token_id)
        text = _token_text(tokenizer, token_id, chosen)
        content.append({
            "token": text, "logprob": chosen.logprob if chosen is not None else None,
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": [{"token": _token_text(tokenizer, t, e), "logprob": e.logprob,
                              "bytes": list(_token_text(tokenizer, t, e).encode("utf-8"))}
                             for t, e in _top(entries, top_n)]})
    return {"content": content}


def _error_event(output) -> dict | None:
    if output.error is None:
        return None
    return {"error": {"message": output.error, "type": "server_error"}}


def _echo_part(output, fmt: Formatting) -> tuple | None:
    if not fmt.echo or output.prompt_logprobs is None:
        return None
    return output.prompt_token_ids, output.prompt_logprobs


# ----- completions ----------------------------------------------------------------------------

def completion_response(request_id: str, model: str, outputs: list,
                        fmt: Formatting) -> dict[str, Any]:
    """`outputs`: one final RequestOutput per prompt, in prompt order."""
    choices = []
    for p, output in enumerate(outputs):
        echo_text = prompt_text(output, fmt.tokenizer) if fmt.echo else ""
        for c in output.outputs:
            choice = {"index": p * fmt.n + c.index, "text": echo_text + c.text,
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                      "logprobs": _completion_logprobs(c, fmt.tokenizer, fmt.top_n, _Offsets(),
                                                       prompt_part=_echo_part(output, fmt))}
            if fmt.prompt_logprobs is not None:
                choice["prompt_logprobs"] = _vllm_prompt_logprobs(output)
            if fmt.return_token_ids:
                choice.update(prompt_token_ids=list(output.prompt_token_ids),
                              token_ids=list(c.token_ids))
            choices.append(choice)
    choices.sort(key=lambda c: c["index"])
    return {"id": request_id, "object": "text_completion", "created": now(), "model": model,
            "choices": choices, "usage": usage_of(outputs)}


class _Deltas:
    """What is new in each choice since the last chunk."""

    def __init__(self) -> None:
        self.text_len: dict[int, int] = {}
        self.tokens: dict[int, int] = {}
        self.finished: set[int] = set()

    def new(self, output, base: int = 0):
        for c in output.outputs:
            key = base + c.index
            if key in self.finished:
                continue
            first = key not in self.text_len
            text = c.text[self.text_len.get(key, 0):]
            start = self.tokens.get(key, 0)
            if first or text or len(c.token_ids) > start or c.finish_reason:
                self.text_len[key] = len(c.text)
                self.tokens[key] = len(c.token_ids)
                if c.finish_reason:
                    self.finished.add(key)
                yield key, c, text, start, first


async def completion_chunk(request_id: str, model: str, outputs: AsyncIterator,
                           include_usage: bool, fmt: Formatting) -> AsyncIterator[dict]:
    """`outputs` yields (prompt index, RequestOutput) as the prompts progress."""
    deltas, created, last = _Deltas(), now(), {}
    offsets: dict[int, _Offsets] = {}
    async for p, output in outputs:
        last[p] = output
        for index, c, text, start, first in deltas.new(output, p * fmt.n):
            if first and not (fmt.echo or text or len(c.token_ids) or c.finish_reason):
                deltas.text_len.pop(index, None)  # nothing to say yet
                continue
            echo = first and fmt.echo
            choice = {"index": index,
                      "text": (prompt_text(output, fmt.tokenizer) if echo else "") + text,
                      "logprobs": _completion_logprobs(
                          c, fmt.tokenizer, fmt.top_n, offsets.setdefault(index, _Offsets()),
                          start, _echo_part(output, fmt) if echo else None),
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if first and fmt.prompt_logprobs is not None:
                choice["prompt_logprobs"] = _vllm_prompt_logprobs(output)
            if fmt.return_token_ids:
                if first:
                    choice["prompt_token_ids"] = list(output.prompt_token_ids)
                choice["token_ids"] = list(c.token_ids[start:])
            yield {"id": request_id, "object": "text_completion", "created": created,
                   "model": model, "choices": [choice]}
        error = _error_event(output)
        if error:
            yield error
    if include_usage and last:
        yield {"id": request_id, "object": "text_completion", "created": created,
               "model": model, "choices": [],
               "usage": usage_of([last[p] for p in sorted(last)])}


# ----- chat completions ------------------------------------------------------------------

def _message(c, fmt: Formatting) -> tuple[dict, str | None]:
    tools = fmt.tools
    if tools is None or tools.choice == "none":
        return {"role": "assistant", "content": c.text}, c.finish_reason
    content, calls, finish = parse_choice(tools.parser(), c.text, tools.parallel,
                                          c.finish_reason)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return message, finish


def chat_response(request_id: str, model: str, output, fmt: Formatting) -> dict[str, Any]:
    choices = []
    for c in output.outputs:
        message, finish = _message(c, fmt)
        choices.append({"index": c.index, "message": message, "finish_reason": finish,
                        "stop_reason": c.stop_reason,
                        "logprobs": _chat_logprobs(c, fmt.tokenizer, fmt.top_n)})
        if fmt.return_token_ids:
            choices[-1]["token_ids"] = list(c.token_ids)
    body = {"id": request_id, "object": "chat.completion", "created": now(), "model": model,
            "choices": choices, "usage": usage_of(output)}
    if fmt.prompt_logprobs is not None:
        body["prompt_logprobs"] = _vllm_prompt_logprobs(output)
    if fmt.return_token_ids:
        body["prompt_token_ids"] = list(output.prompt_token_ids)
    return body


async def chat_chunk(request_id: str, model: str, outputs: AsyncIterator,
                     include_usage: bool, fmt: Formatting) -> AsyncIterator[dict]:
    """`outputs` yields (0, RequestOutput): chat has one prompt."""
    deltas, created, last, opened = _Deltas(), now(), None, set()
    tools = fmt.tools if fmt.tools is not None and fmt.tools.choice != "none" else None
    streamers: dict[int, ToolCallStreamer] = {}
    async for _, output in outputs:
        last = output
        for index, c, text, start, _first in deltas.new(output):
            delta: dict[str, Any] = {}
            finish = c.finish_reason
            if tools is None:
                delta["content"] = text
            else:
                streamer = streamers.setdefault(index, ToolCallStreamer(tools.parser(),
                                                                        tools.parallel))
                content, entries = streamer.feed(c.text, final=finish is not None)
                if content or not entries:
                    delta["content"] = content
                if entries:
                    delta["tool_calls"] = entries
                if streamer.has_calls and finish == "stop":
                    finish = "tool_calls"
                if not content and not entries and finish is None and len(
                        c.token_ids) == start:
                    continue
            chunk = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                     "model": model,
                     "choices": [{"index": index, "delta": delta,
                                  "logprobs": _chat_logprobs(c, fmt.tokenizer, fmt.top_n, start),
                                  "finish_reason": finish}]}
            if fmt.return_token_ids:
                chunk["choices"][0]["token_ids"] = list(c.token_ids[start:])
            if index not in opened:
                opened.add(index)
                delta["role"] = "assistant"
                if fmt.prompt_logprobs is not None and index == 0:
                    chunk["prompt_logprobs"] = _vllm_prompt_logprobs(output)
                if fmt.return_token_ids and len(opened) == 1:
                    chunk["prompt_token_ids"] = list(output.prompt_token_ids)
            yield chunk
        error = _error_event(output)
        if error:
            yield error
    if include_usage and last is not None:
        yield {"id": request_id, "object": "chat.completion.chunk", "created": created,
               "model": model, "choices": [], "usage": usage_of(last)}
