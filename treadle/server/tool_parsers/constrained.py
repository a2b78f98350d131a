"""Tool calls whose shape a grammar enforced (tool_choice 'required' or a named
function; server/tool_calls.py builds the schemas): the named form is the arguments
object itself; the required form is a JSON list [{"name": ..., "parameters": {...}}]."""

from __future__ import annotations

from treadle.server.tool_parsers.base import (ParsedText, ToolCallText, ToolParser,
                                              call_from_object, scan_call_object, skip_ws)


class NamedToolParser(ToolParser):
    """The whole output is the arguments of one known function."""

    name = "named"

    def __init__(self, function_name: str) -> None:
        super().__init__()
        self.function_name = function_name

    def parse(self, text: str, final: bool) -> ParsedText:
        # Surrounding whitespace is not part of the arguments (held back while streaming).
        return ParsedText("", [ToolCallText(self.function_name, text.strip(), final)])


class RequiredToolParser(ToolParser):
    """A JSON list of {"name", "parameters"} objects."""

    name = "required"

    def parse(self, text: str, final: bool) -> ParsedText:
        pos = skip_ws(text, 0)
        if pos >= len(text) or text[pos] != "[":
            return ParsedText(text if final else "")
        calls, pos = [], skip_ws(text, pos + 1)
        while pos < len(text) and text[pos] != "]":
            obj = scan_call_object(text, pos, argument_keys=("parameters",))
            if not obj.valid:
                break
            call = call_from_object(obj)
            if call.name is None and not final:
                break
            calls.append(call)
            if obj.end is None:
                break
            pos = skip_ws(text, obj.end)
            if pos < len(text) and text[pos] == ",":
                pos = skip_ws(text, pos + 1)
        return ParsedText("", [c for c in calls if c.name is not None])
