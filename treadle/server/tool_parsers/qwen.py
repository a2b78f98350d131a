"""Qwen3 XML tool calls (Qwen3-Coder's format):
<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>.
Values are text; each is converted by the tool's JSON schema type (integer, number,
boolean, object, array, null parse as JSON; strings stay strings). The arguments are
then JSON built parameter by parameter, so a streamed prefix never changes."""

from __future__ import annotations

import json
import re

from treadle.server.tool_parsers.base import ParsedText, ToolCallText, ToolParser

_FUNCTION = re.compile(r"<function=([^>\n]+)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>")


class QwenToolParser(ToolParser):
    name = "qwen"
    start, end = "<tool_call>", "</tool_call>"
    markers = ("<tool_call>",)

    def parse(self, text: str, final: bool) -> ParsedText:
        return self.parse_blocks(text, final, self._call)

    def _call(self, text: str, i: int):
        """(the call, index after </tool_call>) from text[i:]; None values while
        incomplete."""
        m = _FUNCTION.search(text, i)
        if m is None:
            return None, None
        name = m.group(1).strip()
        schema = (self.tools.get(name, {}).get("parameters") or {}).get("properties", {})
        pieces, j = [], m.end()
        while True:
            p = _PARAMETER.search(text, j)
            f = text.find("</function>", j)
            if p is None or (0 <= f < p.start()):
                if f < 0:
                    return ToolCallText(name, _arguments(pieces, False)), None
                close = text.find(self.end, f)
                done = ToolCallText(name, _arguments(pieces, True), True)
                return done, (None if close < 0 else close + len(self.end))
            close = text.find("</parameter>", p.end())
            if close < 0:
                return ToolCallText(name, _arguments(pieces, False)), None
            key = p.group(1).strip()
            value = text[p.end():close].strip("\n")
            pieces.append((key, _convert(value, (schema.get(key) or {}).get("type"))))
            j = close + len("</parameter>")


def _arguments(pieces: list, complete: bool) -> str:
    if not pieces and not complete:
        return ""
    body = ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}"
                     for k, v in pieces)
    return "{" + body + ("}" if complete else "")


def _convert(value: str, kind) -> object:
    if kind in ("integer", "number", "boolean", "object", "array", "null"):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value
