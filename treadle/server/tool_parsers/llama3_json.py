"""Llama 3.1/3.2 JSON tool calls: the reply is {"name": "f", "parameters": {...}}
(optionally after <|python_tag|>), several separated by ';'. A reply that does not
start with '{' is plain content."""

from __future__ import annotations

from treadle.server.tool_parsers.base import (ParsedText, ToolParser, call_from_object,
                                              scan_call_object, skip_ws)

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    needs_special_tokens = True
    markers = (PYTHON_TAG,)

    def parse(self, text: str, final: bool) -> ParsedText:
        start = skip_ws(text, 0)
        if text.startswith(PYTHON_TAG, start):
            start = skip_ws(text, start + len(PYTHON_TAG))
        elif PYTHON_TAG.startswith(text[start:]) and not final:
            return ParsedText("")  # could still become the tag
        if start >= len(text):
            return ParsedText("" if not final else text)
        if text[start] != "{":
            return ParsedText(self.held_content(text, final))
        calls, pos = [], start
        while pos < len(text):
            obj = scan_call_object(text, pos)
            if not obj.valid or (final and obj.end is None and obj.name is None):
                return ParsedText(text if final else "", [] if final else calls)
            calls.append(call_from_object(obj))
            if obj.end is None:
                break
            pos = skip_ws(text, obj.end)
            if pos < len(text) and text[pos] == ";":
                pos = skip_ws(text, pos + 1)
            elif pos < len(text):
                # trailing text after the calls is not part of this format
                return ParsedText(text if final else "", [] if final else calls)
        return ParsedText("", calls)
