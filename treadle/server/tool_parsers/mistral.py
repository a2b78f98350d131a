"""Mistral tool calls: [TOOL_CALLS] then a JSON list [{"name": "f", "arguments": {...}}]
(v3 tokenizers), or [TOOL_CALLS]f[ARGS]{...} repeated (v11+ tokenizers). Text before
the first [TOOL_CALLS] is content."""

from __future__ import annotations

from treadle.server.tool_parsers.base import (ParsedText, ToolCallText, ToolParser,
                                              call_from_object, scan_call_object, scan_value,
                                              skip_ws)

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralToolParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True
    markers = (TOOL_CALLS,)

    def parse(self, text: str, final: bool) -> ParsedText:
        k = text.find(TOOL_CALLS)
        if k < 0:
            return ParsedText(self.held_content(text, final))
        content = text[:k].rstrip()
        body_start = skip_ws(text, k + len(TOOL_CALLS))
        if body_start < len(text) and text[body_start] == "[":
            return ParsedText(content, self._json_list(text, body_start))
        return ParsedText(content, self._name_args(text, k))

    def _json_list(self, text: str, i: int) -> list[ToolCallText]:
        calls, pos = [], skip_ws(text, i + 1)
        while pos < len(text) and text[pos] != "]":
            obj = scan_call_object(text, pos)
            if not obj.valid:
                break
            calls.append(call_from_object(obj))
            if obj.end is None:
                break
            pos = skip_ws(text, obj.end)
            if pos < len(text) and text[pos] == ",":
                pos = skip_ws(text, pos + 1)
        return calls

    def _name_args(self, text: str, k: int) -> list[ToolCallText]:
        calls = []
        while k >= 0:
            start = k + len(TOOL_CALLS)
            a = text.find(ARGS, start)
            if a < 0:
                break  # the name is not complete yet
            name = text[start:a].strip()
            j = skip_ws(text, a + len(ARGS))
            if j >= len(text):
                calls.append(ToolCallText(name, ""))
                break
            end = scan_value(text, j)
            if end is None:
                calls.append(ToolCallText(name, text[j:].rstrip()))
                break
            calls.append(ToolCallText(name, text[j:end], True))
            k = text.find(TOOL_CALLS, end)
        return calls
