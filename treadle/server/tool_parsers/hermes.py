"""Hermes-style tool calls (Hermes 2/3, Qwen2.5, and many fine-tunes):
<tool_call>{"name": "f", "arguments": {...}}</tool_call>, any number of them, with
ordinary content around them."""

from __future__ import annotations

from treadle.server.tool_parsers.base import (ParsedText, ToolParser, call_from_object,
                                              scan_call_object, skip_ws)


class HermesToolParser(ToolParser):
    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"
    markers = ("<tool_call>",)

    def parse(self, text: str, final: bool) -> ParsedText:
        content, calls, pos = [], [], 0
        while True:
            k = text.find(self.start, pos)
            if k < 0:
                tail = text[pos:].lstrip() if calls else text[pos:]
                content.append(self.held_content(tail, final))
                break
            content.append((text[pos:k].lstrip() if calls else text[pos:k]).rstrip())
            obj = scan_call_object(text, skip_ws(text, k + len(self.start)))
            if not obj.valid:  # not a call after all: the rest is content
                content.append(self.held_content(text[k:], final))
                break
            calls.append(call_from_object(obj))
            if obj.end is None:
                break
            close = text.find(self.end, obj.end)
            if close < 0:
                break  # the closing tag is still to come
            pos = close + len(self.end)
        return ParsedText("".join(content), calls)
