"""Tool-call parsers: generated text -> content and tool calls (`--tool-call-parser`).

One module per format: hermes, llama3_json, mistral, qwen (Qwen3's XML); constrained.py
reads the outputs that a grammar shaped (tool_choice 'required' or a named function).
"""

from treadle.server.tool_parsers.base import ParsedText, ToolCallText, ToolParser
from treadle.server.tool_parsers.hermes import HermesToolParser
from treadle.server.tool_parsers.llama3_json import Llama3JsonToolParser
from treadle.server.tool_parsers.mistral import MistralToolParser
from treadle.server.tool_parsers.qwen import QwenToolParser

PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser,
                        QwenToolParser)}
"""Parser name (the --tool-call-parser value) -> class."""

__all__ = ["PARSERS", "ParsedText", "ToolCallText", "ToolParser"]
