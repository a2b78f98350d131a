"""What a request's output must match: a grammar spec, as plain data.

Owns the translation of the API's ways of asking for structured output into one
`StructuredSpec`: OpenAI's `response_format` (`json_object`, `json_schema` with `strict`),
vLLM's `structured_outputs` body field (`json`, `regex`, `choice`, `grammar` in EBNF/GBNF
or Lark, `json_object`), and the JSON schema that a `required` or named `tool_choice`
imposes. A spec is immutable, hashable (the compile cache keys on it) and serializable;
it lives in SamplingParams and travels with the request to whichever process samples.

It never imports the grammar library or torch (core/ reads SamplingParams): compiling a
spec into a token matcher is structured/compiler.py's job. Shape errors raise
StructuredOutputError naming the field; a grammar that does not compile is the
compiler's error, naming the construct.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 256 * 1024
"""Largest schema, regex or grammar text accepted (its compiled size is bounded by the
grammar library's own limits)."""
MAX_CHOICES = 1024


class StructuredOutputError(ValueError):
    """A structured-output request that cannot be served; `field` names where."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.detail = field, message


@dataclass(frozen=True)
class StructuredSpec:
    """One grammar the output must match.

    kind: 'json' (value: a JSON schema as compact JSON text, key order kept), 'json_object' (any JSON
    object; value ''), 'regex' (value: the pattern, matched against the whole output),
    'choice' (value: a JSON list of the allowed strings), 'grammar' (value: Lark or
    EBNF/GBNF text). `field` is the request field it came from (errors name it).
    `compact_json` drops optional whitespace from JSON output; otherwise JSON is written
    with json.dumps' separators (', ' and ': ') and no other whitespace, so a model cannot
    pad its output with endless blank lines.
    """

    kind: str
    value: str
    field: str = "structured_outputs"
    compact_json: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise StructuredOutputError(self.field, f"kind must be one of {', '.join(KINDS)}, "
                                        f"got {self.kind!r}")
        if not isinstance(self.value, str):
            raise StructuredOutputError(self.field, "the grammar must be given as text")
        if len(self.value) > MAX_SPEC_CHARS:
            raise StructuredOutputError(self.field, f"at most {MAX_SPEC_CHARS} characters, "
                                        f"got {len(self.value)}")

    @property
    def key(self) -> tuple[str, str, bool]:
        """What the compile cache keys on (the field name does not change the grammar)."""
        return (self.kind, self.value, self.compact_json)

    @classmethod
    def json_schema(cls, schema: Any, field: str, compact: bool = False) -> "StructuredSpec":
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise StructuredOutputError(field, f"the schema is not valid JSON: {exc}") \
                    from None
        if isinstance(schema, bool):
            schema = {} if schema else {"not": {}}
        if not isinstance(schema, dict):
            raise StructuredOutputError(field, "a JSON schema must be an object, got "
                                        f"{type(schema).__name__}")
        # Key order is kept: properties are generated in the schema's order.
        return cls("json", json.dumps(schema, separators=(",", ":")), field, compact)


def from_response_format(response_format: dict | None,
                         field: str = "response_format") -> StructuredSpec | None:
    """OpenAI's `response_format`: {'type': 'text'} -> None; 'json_object'; 'json_schema'
    with {'json_schema': {'name', 'schema', 'strict'}}. `strict: false` is enforced all
    the same (the output is never looser than asked)."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise StructuredOutputError(field, "must be an object with a 'type'")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredSpec("json_object", "", f"{field}.type")
    if kind == "json_schema":
        body = response_format.get("json_schema")
        if not isinstance(body, dict):
            raise StructuredOutputError(f"{field}.json_schema",
                                        "is required with type 'json_schema' and must be an "
                                        "object with 'name' and 'schema'")
        if "schema" not in body:
            raise StructuredOutputError(f"{field}.json_schema.schema", "is required")
        strict = body.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise StructuredOutputError(f"{field}.json_schema.strict", "must be a boolean")
        return StructuredSpec.json_schema(body["schema"], f"{field}.json_schema.schema")
    raise StructuredOutputError(f"{field}.type", "must be 'text', 'json_object' or "
                                f"'json_schema', got {kind!r}")


_SO_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_SO_OPTIONS = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties",
               "whitespace_pattern")


def from_structured_outputs(body: dict | None,
                            field: str = "structured_outputs") -> StructuredSpec | None:
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar,
    json_object; options disable_any_whitespace (compact JSON) and
    disable_additional_properties (objects get additionalProperties: false);
    disable_fallback is accepted (there is one backend and no fallback)."""
    if body is None:
        return None
    if not isinstance(body, dict):
        raise StructuredOutputError(field, "must be an object")
    unknown = sorted(set(body) - set(_SO_KINDS) - set(_SO_OPTIONS))
    if unknown:
        raise StructuredOutputError(f"{field}.{unknown[0]}", "is not a field of "
                                    f"structured_outputs (known: {', '.join(_SO_KINDS + _SO_OPTIONS)})")
    given = [k for k in _SO_KINDS if body.get(k) not in (None, False)]
    if len(given) != 1:
        raise StructuredOutputError(field, "exactly one of json, regex, choice, grammar, "
                                    f"json_object is needed, got {given or 'none'}")
    kind = given[0]
    where = f"{field}.{kind}"
    if body.get("whitespace_pattern") is not None:
        raise StructuredOutputError(f"{field}.whitespace_pattern", "is not supported; use "
                                    "disable_any_whitespace for compact JSON")
    compact = bool(body.get("disable_any_whitespace"))
    if kind == "structural_tag":
        raise StructuredOutputError(where, "is not supported")
    value = body[kind]
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise StructuredOutputError(where, f"the schema is not valid JSON: {exc}") \
                    from None
        if body.get("disable_additional_properties") and isinstance(value, dict):
            value = _close_objects(value)
        return StructuredSpec.json_schema(value, where, compact)
    if kind == "json_object":
        if value is not True:
            raise StructuredOutputError(where, "must be true")
        return StructuredSpec("json_object", "", where, compact)
    if kind == "choice":
        if (not isinstance(value, list) or not value or len(value) > MAX_CHOICES
                or not all(isinstance(c, str) for c in value)):
            raise StructuredOutputError(where, f"must be a list of 1 to {MAX_CHOICES} strings")
        return StructuredSpec("choice", json.dumps(value), where)
    if not isinstance(value, str) or not value:
        raise StructuredOutputError(where, "must be a non-empty string")
    return StructuredSpec(kind, value, where)


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalItems", "not", "if", "then", "else", "contains",
               "additionalProperties")


def _close_objects(schema: Any) -> Any:
    """The schema with additionalProperties: false on every object schema that does not
    say otherwise (recursing through the keywords whose values are schemas)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _close_objects(s) for name, s in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_close_objects(s) for s in out[key]]
    for key in _SCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = _close_objects(out[key])
    if (out.get("type") == "object" or "properties" in out) and \
            "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
