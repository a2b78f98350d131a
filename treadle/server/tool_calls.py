"""Tool calling in chat completions: tools and tool_choice in, message.tool_calls out.

Owns the checks of `tools`, `tool_choice` and `parallel_tool_calls`; what the chat
template gets (the function definitions; none with tool_choice 'none'); the grammar that
`required` and a named function impose (a StructuredSpec: the engine enforces it like
any structured output); which parser reads a choice's text (`--tool-call-parser` for
'auto', the constrained forms otherwise); the non-streamed `tool_calls` with ids and
finish_reason 'tool_calls'; and `ToolCallStreamer`, which turns a growing text into
OpenAI's streamed deltas: a first chunk with index, id, type and name, then argument
fragments. Messages with tool calls and `tool` messages are rendered for the template
here too. It never talks to the engine.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from treadle.server.tool_parsers import PARSERS, ToolParser
from treadle.server.tool_parsers.constrained import NamedToolParser, RequiredToolParser
from treadle.structured.spec import StructuredOutputError, StructuredSpec

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
MAX_TOOLS = 128


class ToolRequestError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolSetup:
    """What a chat request's tools mean for templating, sampling and parsing."""

    template_tools: list[dict] | None
    """Function definitions for apply_chat_template(tools=...); None: no tools."""
    spec: StructuredSpec | None
    """The grammar of 'required' or a named choice; None for 'auto' and 'none'."""
    choice: str
    """'none', 'auto', 'required' or 'named'."""
    functions: list[dict]
    parallel: bool
    parser_name: str | None = None
    named: str | None = None

    def parser(self) -> ToolParser | None:
        """A fresh parser for one choice (parsers keep no state, but get the tools)."""
        if self.choice == "named":
            return NamedToolParser(self.named)
        if self.choice == "required":
            return RequiredToolParser(self.functions)
        if self.choice == "auto":
            return PARSERS[self.parser_name](self.functions)
        return None

    @property
    def needs_special_tokens(self) -> bool:
        return self.choice == "auto" and PARSERS[self.parser_name].needs_special_tokens


def setup_tools(tools: list[dict] | None, tool_choice: Any, parallel_tool_calls: bool | None,
                parser_name: str | None, enable_auto_tool_choice: bool) -> ToolSetup:
    """Check the request's tool fields (ToolRequestError naming the field)."""
    try:
        return _setup_tools(tools, tool_choice, parallel_tool_calls, parser_name,
                            enable_auto_tool_choice)
    except StructuredOutputError as exc:  # a tool's schema too large or malformed
        raise ToolRequestError(exc.field, exc.detail) from None


def _setup_tools(tools: list[dict] | None, tool_choice: Any, parallel_tool_calls: bool | None,
                 parser_name: str | None, enable_auto_tool_choice: bool) -> ToolSetup:
    functions = _functions(tools)
    parallel = True if parallel_tool_calls is None else bool(parallel_tool_calls)
    if tool_choice is None:
        tool_choice = "auto" if functions else "none"
    if not functions:
        if tool_choice != "none":
            raise ToolRequestError("tool_choice", "needs tools")
        return ToolSetup(None, None, "none", [], parallel)
    template_tools = [{"type": "function", "function": f} for f in functions]
    if tool_choice == "none":
        return ToolSetup(None, None, "none", functions, parallel)
    if tool_choice == "auto":
        if not enable_auto_tool_choice or parser_name is None:
            raise ToolRequestError("tool_choice", "'auto' needs the server started with "
                                   "--enable-auto-tool-choice and --tool-call-parser "
                                   f"({', '.join(sorted(PARSERS))}); use 'required' or a "
                                   "named function, which a grammar enforces")
        return ToolSetup(template_tools, None, "auto", functions, parallel, parser_name)
    if tool_choice == "required":
        return ToolSetup(template_tools, StructuredSpec.json_schema(
            required_schema(functions, parallel), "tool_choice"), "required", functions,
            parallel)
    if isinstance(tool_choice, dict):
        if tool_choice.get("type") != "function" or not isinstance(
                tool_choice.get("function"), dict):
            raise ToolRequestError("tool_choice", "must be 'none', 'auto', 'required' or "
                                   "{'type': 'function', 'function': {'name': ...}}")
        name = tool_choice["function"].get("name")
        chosen = next((f for f in functions if f["name"] == name), None)
        if chosen is None:
            raise ToolRequestError("tool_choice.function.name",
                                   f"{name!r} is not one of the tools")
        schema = chosen.get("parameters") or {"type": "object", "properties": {}}
        return ToolSetup(template_tools, StructuredSpec.json_schema(
            schema, "tool_choice.function"), "named", functions, parallel, named=name)
    raise ToolRequestError("tool_choice", "must be 'none', 'auto', 'required' or "
                           f"{{'type': 'function', 'function': {{'name': ...}}}}, got "
                           f"{tool_choice!r}")


def _functions(tools: list[dict] | None) -> list[dict]:
    if not tools:
        return []
    if len(tools) > MAX_TOOLS:
        raise ToolRequestError("tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
    functions, seen = [], set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ToolRequestError(f"tools[{i}].type", "only 'function' tools are supported")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ToolRequestError(f"tools[{i}].function", "is required")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ToolRequestError(f"tools[{i}].function.name", "must be 1 to 64 letters, "
                                   "digits, '_' or '-'")
        if name in seen:
            raise ToolRequestError(f"tools[{i}].function.name", f"{name!r} appears twice")
        seen.add(name)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise ToolRequestError(f"tools[{i}].function.parameters", "must be a JSON schema")
        functions.append({k: v for k, v in function.items() if v is not None})
    return functions


def required_schema(functions: list[dict], parallel: bool) -> dict:
    """A JSON list of one or more {"name": <a tool>, "parameters": <its schema>}."""
    items = {"anyOf": [{
        "type": "object",
        "properties": {"name": {"type": "string", "enum": [f["name"]]},
                       "parameters": f.get("parameters") or {"type": "object"}},
        "required": ["name", "parameters"], "additionalProperties": False}
        for f in functions]}
    schema: dict = {"type": "array", "minItems": 1, "items": items}
    if not parallel:
        schema["maxItems"] = 1
    return schema


# ----- messages for the chat template -----------------------------------------------------

def template_message(message) -> dict:
    """A protocol.ChatMessage as chat templates expect it (tool-call arguments as dicts,
    as Hugging Face templates index them)."""
    out: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        calls = []
        for call in message.tool_calls:
            arguments = call.function.arguments
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    pass  # the template gets the text as the model wrote it
            calls.append({"id": call.id, "type": "function",
                          "function": {"name": call.function.name, "arguments": arguments}})
        out["tool_calls"] = calls
    return out


# ----- outputs ----------------------------------------------------------------------------

def parse_choice(parser: ToolParser, text: str, parallel: bool,
                 finish_reason: str | None) -> tuple[str | None, list[dict], str | None]:
    """(content, tool_calls, finish_reason) of a finished choice."""
    parsed = parser.parse(text, final=True)
    calls = [c for c in parsed.calls if c.name is not None]
    if not parallel:
        calls = calls[:1]
    tool_calls = [{"id": call_id(), "type": "function",
                   "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
    if tool_calls and finish_reason == "stop":
        finish_reason = "tool_calls"
    return (parsed.content or None) if tool_calls else parsed.content, tool_calls, \
        finish_reason


class ToolCallStreamer:
    """Successive texts of one choice -> content deltas and delta.tool_calls entries."""

    def __init__(self, parser: ToolParser, parallel: bool) -> None:
        self.parser, self.parallel = parser, parallel
        self.content = ""
        self.calls: list[list[str]] = []  # per announced call: [id, arguments sent]

    def feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        """(new content, new tool_calls entries) since the previous call."""
        parsed = self.parser.parse(text, final)
        new_content = ""
        if parsed.content.startswith(self.content):
            new_content = parsed.content[len(self.content):]
            self.content = parsed.content
        entries = []
        for i, call in enumerate(parsed.calls):
            if i > 0 and not self.parallel:
                break
            if i == len(self.calls):
                if call.name is None:
                    break
                self.calls.append([call_id(), ""])
                entries.append({"index": i, "id": self.calls[i][0], "type": "function",
                                "function": {"name": call.name, "arguments": ""}})
            sent = self.calls[i][1]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                entries.append({"index": i,
                                "function": {"arguments": call.arguments[len(sent):]}})
                self.calls[i][1] = call.arguments
        return new_content, entries

    @property
    def has_calls(self) -> bool:
        return bool(self.calls)
