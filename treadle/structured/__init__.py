"""Structured outputs: grammars that constrain what a request may generate.

`spec` (pure data, no grammar library: it rides in SamplingParams), `compiler` (spec ->
llguidance grammar for one tokenizer, cached) and `matcher` (per-request state, the
per-step bitmasks of a batch, applying them to logits). The engine side calls, per step:
BitmaskFiller.submit(...) while the forward pass runs, apply_bitmask_(...) on the
constrained rows' logits, StructuredRequest.accept(...) with the sampled tokens.
"""

from treadle.structured.spec import (StructuredOutputError, StructuredSpec,
                                     from_response_format, from_structured_outputs)

__all__ = ["StructuredOutputError", "StructuredSpec", "from_response_format",
           "from_structured_outputs"]
