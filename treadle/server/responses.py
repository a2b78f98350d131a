"""OpenAI response bodies and server-sent-event chunks from the engine's RequestOutputs.

Owns the shapes of the API's answers: completions and chat completions, whole or as
streamed deltas (each chunk carries only the text and tokens that are new since the
previous one), usage, and logprobs in each endpoint's format. Pure formatting.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from treadle.server.protocol import now


def usage_of(output) -> dict[str, int]:
    completion = sum(len(c.token_ids) for c in output.outputs)
    prompt = len(output.prompt_token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _token_text(tokenizer, token_id: int, entry) -> str:
    text = getattr(entry, "decoded_token", None)
    if text is None and tokenizer is not None:
        text = tokenizer.decode([token_id])
    return text if text is not None else str(token_id)


def _top(entries: dict, top_n: int) -> list:
    """The top_n (token id, entry) pairs by rank; the chosen token is among the entries
    even when it ranks lower, and is then left out here."""
    return sorted(entries.items(), key=lambda kv: kv[1].rank)[:top_n]


def _completion_logprobs(choice, tokenizer, top_n: int, start: int = 0) -> dict | None:
    """{tokens, token_logprobs, top_logprobs, text_offset} for generated tokens [start:]."""
    if choice.logprobs is None:
        return None
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = 0
    for token_id, entries in zip(choice.token_ids[start:], choice.logprobs[start:]):
        chosen = entries.get(token_id)
        text = _token_text(tokenizer, token_id, chosen)
        tokens.append(text)
        token_logprobs.append(chosen.logprob if chosen is not None else None)
        top.append({_token_text(tokenizer, t, e): e.logprob for t, e in _top(entries, top_n)})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
            "text_offset": offsets}


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


def completion_response(request_id: str, model: str, output, tokenizer,
                        top_n: int = 0) -> dict[str, Any]:
    return {
        "id": request_id, "object": "text_completion", "created": now(), "model": model,
        "choices": [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                     "stop_reason": c.stop_reason,
                     "logprobs": _completion_logprobs(c, tokenizer, top_n)}
                    for c in output.outputs],
        "usage": usage_of(output),
    }


def chat_response(request_id: str, model: str, output, tokenizer,
                  top_n: int = 0) -> dict[str, Any]:
    return {
        "id": request_id, "object": "chat.completion", "created": now(), "model": model,
        "choices": [{"index": c.index,
                     "message": {"role": "assistant", "content": c.text},
                     "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                     "logprobs": _chat_logprobs(c, tokenizer, top_n)} for c in output.outputs],
        "usage": usage_of(output),
    }


class _Deltas:
    """What is new in each choice since the last chunk."""

    def __init__(self) -> None:
        self.text_len: dict[int, int] = {}
        self.tokens: dict[int, int] = {}
        self.finished: set[int] = set()

    def new(self, output):
        for c in output.outputs:
            if c.index in self.finished:
                continue
            text = c.text[self.text_len.get(c.index, 0):]
            start = self.tokens.get(c.index, 0)
            if text or len(c.token_ids) > start or c.finish_reason:
                self.text_len[c.index] = len(c.text)
                self.tokens[c.index] = len(c.token_ids)
                if c.finish_reason:
                    self.finished.add(c.index)
                yield c, text, start


async def completion_chunk(request_id: str, model: str, outputs: AsyncIterator,
                           include_usage: bool, tokenizer, top_n: int = 0) -> AsyncIterator[dict]:
    deltas, created, last = _Deltas(), now(), None
    async for output in outputs:
        last = output
        for c, text, start in deltas.new(output):
            yield {"id": request_id, "object": "text_completion", "created": created,
                   "model": model,
                   "choices": [{"index": c.index, "text": text,
                                "logprobs": _completion_logprobs(c, tokenizer, top_n, start),
                                "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason}]}
        error = _error_event(output)
        if error:
            yield error
    if include_usage and last is not None:
        yield {"id": request_id, "object": "text_completion", "created": created,
               "model": model, "choices": [], "usage": usage_of(last)}


async def chat_chunk(request_id: str, model: str, outputs: AsyncIterator,
                     include_usage: bool, tokenizer, top_n: int = 0) -> AsyncIterator[dict]:
    deltas, created, last, opened = _Deltas(), now(), None, set()
    async for output in outputs:
        last = output
        for c, text, start in deltas.new(output):
            delta: dict[str, Any] = {"content": text}
            if c.index not in opened:
                opened.add(c.index)
                delta["role"] = "assistant"
            yield {"id": request_id, "object": "chat.completion.chunk", "created": created,
                   "model": model,
                   "choices": [{"index": c.index, "delta": delta,
                                "logprobs": _chat_logprobs(c, tokenizer, top_n, start),
                                "finish_reason": c.finish_reason}]}
        error = _error_event(output)
        if error:
            yield error
    if include_usage and last is not None:
        yield {"id": request_id, "object": "chat.completion.chunk", "created": created,
               "model": model, "choices": [], "usage": usage_of(last)}
