"""What every tool-call parser returns, and the JSON scanning they share.

A parser reads a choice's generated text so far and splits it into the content to show
and the tool calls it holds: each with its name once that is complete and the raw JSON
text of its arguments as far as it is known. Called again on a longer text, it returns
a longer content and arguments that extend the earlier ones, which is what streaming
needs (server/tool_calls.py turns successive results into delta.tool_calls chunks).

Content next to a tool call is stripped of the whitespace that separates them; while
the text is not final, trailing whitespace and anything that could be the start of a
tool-call marker are held back. Pure text processing: no tokenizer, no engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

_WS = " \t\r\n"


@dataclass
class ToolCallText:
    """One tool call as far as the text goes."""

    name: str | None
    arguments: str
    """Raw JSON text of the arguments so far (complete once `complete`)."""
    complete: bool = False


@dataclass
class ParsedText:
    content: str
    calls: list[ToolCallText] = field(default_factory=list)


NOT_A_CALL = object()
"""What a block reader returns for a block that is not a call (ToolParser.parse_blocks)."""


class ToolParser:
    """Base class: `parse(text, final)`; `needs_special_tokens` when its markers are
    special tokens that detokenization would otherwise drop."""

    name = ""
    needs_special_tokens = False
    markers: tuple[str, ...] = ()

    def __init__(self, tools: list[dict] | None = None) -> None:
        """`tools`: the request's function definitions ({name, parameters, ...})."""
        self.tools = {t["name"]: t for t in tools or []}

    def parse(self, text: str, final: bool) -> ParsedText:
        raise NotImplementedError

    def parse_blocks(self, text: str, final: bool, read_call) -> ParsedText:
        """Content around `start` ... `end` blocks, one call each (the tagged formats).
        read_call(text, i) reads the call that starts at text[i] (just after `start`):
        (call, index after its `end`); the index is None while the block runs to the
        text's end; call None while nothing of it is readable yet, NOT_A_CALL when the
        block is not a call after all (it and the rest are content)."""
        content, calls, pos = [], [], 0
        while True:
            k = text.find(self.start, pos)
            if k < 0:
                tail = text[pos:].lstrip() if calls else text[pos:]
                content.append(self.held_content(tail, final))
                break
            content.append((text[pos:k].lstrip() if calls else text[pos:k]).rstrip())
            call, end = read_call(text, k + len(self.start))
            if call is NOT_A_CALL:
                content.append(self.held_content(text[k:], final))
                break
            if call is None:
                break
            calls.append(call)
            if end is None:
                break
            pos = end
        return ParsedText("".join(content), calls)

    def held_content(self, text: str, final: bool) -> str:
        """`text` as content: all of it when final, else without a trailing partial
        marker and trailing whitespace."""
        if final:
            return text
        for marker in self.markers:
            for k in range(min(len(marker) - 1, len(text)), 0, -1):
                if text.endswith(marker[:k]):
                    text = text[:-k]
                    break
        return text.rstrip(_WS)


def skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def scan_string(s: str, i: int) -> int | None:
    """s[i] is '"': the index after the closing quote, or None if it has not come yet."""
    j = i + 1
    while j < len(s):
        c = s[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def scan_value(s: str, i: int) -> int | None:
    """The index after the JSON value starting at s[i], or None if it is incomplete."""
    if s[i] in "{[":
        depth, j = 0, i
        while j < len(s):
            c = s[j]
            if c == '"':
                end = scan_string(s, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    if s[i] == '"':
        return scan_string(s, i)
    j = i
    while j < len(s) and s[j] not in ",}]" + _WS:
        j += 1
    return j if j < len(s) else None


@dataclass
class CallObject:
    """A scanned {"name": ..., "arguments": {...}} object."""

    name: str | None = None
    arguments: str | None = None
    arguments_complete: bool = False
    end: int | None = None
    """Index after the closing brace; None while the object is incomplete."""
    valid: bool = True


def scan_call_object(s: str, i: int, argument_keys=("arguments", "parameters")) -> CallObject:
    """Scan a tool-call object starting at s[i] as far as the text goes."""
    out = CallObject()
    if i >= len(s):
        return out
    if s[i] != "{":
        out.valid = False
        return out
    j = i + 1
    while True:
        j = skip_ws(s, j)
        if j >= len(s):
            return out
        if s[j] == "}":
            out.end = j + 1
            return out
        if s[j] == ",":
            j += 1
            continue
        if s[j] != '"':
            out.valid = False
            return out
        key_end = scan_string(s, j)
        if key_end is None:
            return out
        try:
            key = json.loads(s[j:key_end])
        except ValueError:
            out.valid = False
            return out
        j = skip_ws(s, key_end)
        if j >= len(s):
            return out
        if s[j] != ":":
            out.valid = False
            return out
        j = skip_ws(s, j + 1)
        if j >= len(s):
            return out
        end = scan_value(s, j)
        if key == "name":
            if end is None:
                return out
            try:
                out.name = json.loads(s[j:end])
            except ValueError:
                out.valid = False
                return out
            if not isinstance(out.name, str):
                out.valid = False
                return out
        elif key in argument_keys:
            if end is None:
                if s[j] in "{[":
                    out.arguments = s[j:].rstrip(_WS)
                return out
            raw = s[j:end]
            if s[j] == '"':  # arguments given as a JSON string holding JSON
                try:
                    raw = json.loads(raw)
                except ValueError:
                    out.valid = False
                    return out
            out.arguments, out.arguments_complete = raw, True
        elif end is None:
            return out
        j = end


def call_from_object(obj: CallObject) -> ToolCallText:
    complete = obj.end is not None
    arguments = obj.arguments if obj.arguments is not None else ("{}" if complete else "")
    return ToolCallText(obj.name, arguments, complete)
