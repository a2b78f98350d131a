"""Hermes-style tool calls (Hermes 2/3, Qwen2.5, and many fine-tunes):
<tool_call>{"name": "f", "arguments": {...}}</tool_call>, any number of them, with
ordinary content around them."""

from __future__ import annotations

from treadle.server.tool_parsers.base import (NOT_A_CALL, ParsedText, ToolParser,
                                              call_from_object, scan_call_object, skip_ws)


class HermesToolParser(ToolParser):
    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"
    markers = ("<tool_call>",)

    def parse(self, text: str, final: bool) -> ParsedText:
        return self.parse_blocks(text, final, self._call)

    def _call(self, text: str, i: int):
        obj = scan_call_object(text, skip_ws(text, i))
        if not obj.valid:
            return NOT_A_CALL, None
        call = call_from_object(obj)
        if obj.end is None:
            return call, None
        close = text.find(self.end, obj.end)
        return call, (None if close < 0 else close + len(self.end))  # the tag may be to come
