"""Request and response bodies of the OpenAI-compatible API (pydantic), with their bounds.

Owns the wire format: field names and types follow the OpenAI API plus vLLM's sampling
extensions and `priority`. Every field is bounded here, in its type, so that the OpenAPI
schema states exactly what the validators accept (bounds that depend on the model, such
as the vocabulary and the context, are added to the schema by server/openapi.py). A
violation is a 400 naming the field before anything reaches the engine. Types are strict
(a number sent as a string is an error, as the schema says; 2.0 is the integer 2, as in
JSON Schema), and no text may hold a lone UTF-16 surrogate, which no tokenizer can
encode. It does not tokenize or talk to the engine.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

MAX_N = 16
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_PROMPT_TOKENS_LIST = 1_000_000
MAX_TOKEN_ID = 2**31 - 1
MAX_MESSAGES = 1024
MAX_PROMPTS = 64
"""Most prompts in one batched completions request (each runs n samples)."""
MAX_TOOLS = 128
MAX_SEED = 2**53 - 1
MAX_SLO_MS = 86_400_000.0
"""The longest deadline a request may carry (a day, in milliseconds)."""
SLO_TTFT_HEADER = "x-slo-ttft-ms"
"""The Kubernetes Gateway API Inference Extension's TTFT objective header (milliseconds)."""
"""The largest integer every JSON reader holds exactly (float64 ones too, as JavaScript's and
schema validators'); beyond it a seed would not round-trip."""
MAX_LOGIT_BIAS_KEY_DIGITS = 9
"""logit_bias keys are decimal token ids (no leading zeros) of at most this many digits."""

TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
PromptText = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_TOKENS_LIST)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]
BiasKey = Annotated[str, Field(
    pattern=rf"^(0|[1-9][0-9]{{0,{MAX_LOGIT_BIAS_KEY_DIGITS - 1}}})$")]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _is_lone_surrogate_free(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def surrogate_path(value: Any, path: tuple = ()) -> tuple | None:
    """Where in a JSON value the first string (or key) holding a lone UTF-16 surrogate is
    (JSON's "\\ud800" escapes decode to one); None if there is none."""
    if isinstance(value, str):
        return None if _is_lone_surrogate_free(value) else path
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and not _is_lone_surrogate_free(key):
                return path
            found = surrogate_path(item, path + (key,))
            if found is not None:
                return found
    elif isinstance(value, list):
        if all(type(item) is int for item in value):  # token ids: nothing to look at
            return None
        for i, item in enumerate(value):
            found = surrogate_path(item, path + (i,))
            if found is not None:
                return found
    return None


def integral_floats_as_ints(value: Any) -> Any:
    """2.0 -> 2 throughout a JSON value: JSON Schema counts a number with no fraction as an
    integer, and the strict types would refuse it (a float field still takes an int)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: integral_floats_as_ints(v) for k, v in value.items()}
    if isinstance(value, list):
        if all(type(item) is int for item in value):
            return value
        return [integral_floats_as_ints(item) for item in value]
    return value


class OpenAIModel(BaseModel):
    # Unknown fields are kept so that server/fields.py can refuse them by name (or accept
    # the few listed there as ignored): nothing is silently dropped.
    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data):
        path = surrogate_path(data)
        if path is not None:
            field = ".".join(str(p) for p in path)
            raise PydanticCustomError(
                "lone_surrogate", "text holds a lone UTF-16 surrogate (not valid Unicode)",
                {"field": field})
        return integral_floats_as_ints(data)


class StreamOptions(OpenAIModel):
    include_usage: bool = False


MAX_ALLOWED_TOKEN_IDS = 262_144
MAX_BAD_WORDS = 128
MAX_DRY_BREAKERS = 64
BreakerString = Annotated[str, Field(min_length=1, max_length=40)]
BadWord = Annotated[str, Field(min_length=1, max_length=256)]


class SamplerExtensions(OpenAIModel):
    """vLLM's sampling extensions and llama.cpp's DRY and XTC, on every generating
    endpoint (their meaning: treadle/sampling_params.py and docs/openai_api.md)."""

    allowed_token_ids: Optional[Annotated[list[TokenId], Field(
        min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)]] = Field(
        default=None, description="vLLM's: only these token ids may be generated")
    bad_words: Optional[Annotated[list[BadWord], Field(max_length=MAX_BAD_WORDS)]] = Field(
        default=None, description="vLLM's: words that are never generated")
    spaces_between_special_tokens: bool = Field(
        default=True, description="vLLM's: false joins consecutive special tokens in the "
        "text (with skip_special_tokens false)")
    cache_salt: Optional[str] = Field(
        default=None, min_length=1, max_length=1024,
        description="vLLM's: only requests with the same salt share cached prompt blocks")
    dry_multiplier: float = Field(default=0.0, ge=0.0, le=100.0,
                                  description="llama.cpp's DRY penalty; 0: off")
    dry_base: float = Field(default=1.75, ge=1.0, le=100.0)
    dry_allowed_length: int = Field(default=2, ge=0, le=1_000_000)
    dry_penalty_last_n: int = Field(
        default=-1, ge=-1, le=MAX_PROMPT_TOKENS_LIST,
        description="tokens of the history DRY looks at; -1: all, 0: DRY off")
    dry_sequence_breakers: Optional[Annotated[list[BreakerString], Field(
        min_length=1, max_length=MAX_DRY_BREAKERS)]] = Field(
        default=None, description='default ["\\n", ":", "\\"", "*"] (llama.cpp\'s)')
    xtc_probability: float = Field(default=0.0, ge=0.0, le=1.0,
                                   description="llama.cpp's XTC; 0: off")
    xtc_threshold: float = Field(default=0.1, ge=0.0, le=1.0)


class TokenOutputFields(OpenAIModel):
    """vLLM's prompt and output token fields of completions and chat completions."""

    return_token_ids: bool = Field(
        default=False, description="vLLM's: prompt_token_ids and each choice's token_ids "
        "in the response (a stream: the prompt's in the first chunk, then deltas)")
    truncate_prompt_tokens: Optional[int] = Field(
        default=None, ge=-1, le=MAX_PROMPT_TOKENS_LIST,
        description="vLLM's: keep the prompt's last this many tokens; -1: max_model_len")


class SamplingFields(SamplerExtensions):
    """Fields shared by completions and chat completions."""

    model: Optional[str] = Field(default=None, max_length=512)
    max_tokens: Optional[int] = Field(default=None, ge=0, le=1_000_000,
                                      description="0 only with echo or prompt_logprobs")
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, le=1_000_000)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    seed: Optional[int] = Field(default=None, ge=0, le=MAX_SEED)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: Optional[Union[StopString, Annotated[list[StopString],
                                               Field(max_length=MAX_STOP_STRINGS)]]] = None
    stop_token_ids: Optional[list[TokenId]] = Field(default=None, max_length=MAX_STOP_STRINGS)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, le=1_000_000)
    logit_bias: Optional[dict[BiasKey, Bias]] = Field(default=None,
                                                      max_length=MAX_LOGIT_BIAS_ENTRIES)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    priority: int = Field(default=0, ge=-1_000_000, le=1_000_000)
    slo_ttft_ms: Optional[float] = Field(
        default=None, gt=0, le=MAX_SLO_MS,
        description="treadle's: time-to-first-token target in ms (the slo scheduling policy "
        "orders by it; also the x-slo-ttft-ms header)")
    slo_tpot_ms: Optional[float] = Field(
        default=None, gt=0, le=MAX_SLO_MS,
        description="treadle's: target time per output token after the first, in ms (the "
        "slo scheduling policy)")
    user: Optional[str] = Field(default=None, max_length=256)
    response_format: Optional[dict[str, Any]] = Field(
        default=None, description="{'type': 'text' | 'json_object' | 'json_schema', ...}")
    structured_outputs: Optional[dict[str, Any]] = Field(
        default=None, description="vLLM's: one of json, regex, choice, grammar, json_object")
    prompt_logprobs: Optional[int] = Field(
        default=None, ge=0, le=MAX_LOGPROBS,
        description="vLLM's: logprobs of every prompt token and this many alternatives")
    speculative: bool = Field(
        default=True, description="treadle's: false opts this request out of speculative decoding "
        "(the output is the same either way)")

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(SamplingFields, TokenOutputFields):
    prompt: Union[PromptText, TokenIds,
                  Annotated[list[PromptText], Field(min_length=1, max_length=MAX_PROMPTS)],
                  Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]] = Field(
        description="a string, token ids, or a batch of either (one choice per prompt x n)")
    echo: bool = False
    logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_kind_of_prompt(cls, value):
        """A list holds strings, or token ids, or lists of token ids: never a mix (a
        string of digits stays text, as OpenAI reads it)."""
        if isinstance(value, list) and value:
            kinds = {"a string" if isinstance(v, str) else "a list" if isinstance(v, list)
                     else "a token id" for v in value}
            if len(kinds) > 1:
                raise PydanticCustomError(
                    "prompt_mix", "a list of prompts mixes " + " and ".join(sorted(kinds))
                    + "; send strings, token ids, or lists of token ids")
        return value

    @field_validator("prompt")
    @classmethod
    def _bounded_prompts(cls, value):
        batch = value if isinstance(value, list) and value and isinstance(
            value[0], (str, list)) else [value]
        if len(batch) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts in one request, got {len(batch)}")
        if sum(len(p) for p in batch if isinstance(p, list)) > MAX_PROMPT_TOKENS_LIST:
            raise ValueError(f"at most {MAX_PROMPT_TOKENS_LIST} prompt token ids")
        for p in batch:
            if isinstance(p, list) and any(not 0 <= t <= MAX_TOKEN_ID for t in p):
                raise ValueError("prompt token ids must be non-negative")
        return value

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompts of the batch (one for an unbatched request)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return list(p)
        return [p]


class TextPart(OpenAIModel):
    """A content part; only text parts are supported."""

    type: Literal["text"]
    text: str


class ToolCallFunction(OpenAIModel):
    name: str = Field(max_length=256)
    arguments: Union[str, dict[str, Any]] = "{}"
    """JSON text, as OpenAI sends it (an object is taken as it is)."""


class ToolCall(OpenAIModel):
    """One call of an assistant message, as the chat completion answered it."""

    id: Optional[str] = Field(default=None, max_length=256)
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(OpenAIModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = Field(default=None, max_length=256)
    tool_calls: Optional[list[ToolCall]] = Field(default=None, max_length=MAX_TOOLS)
    """An assistant message's calls."""
    tool_call_id: Optional[str] = Field(default=None, max_length=256)
    """A tool message: the id of the call it answers."""

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields, TokenOutputFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1, le=1_000_000)
    add_generation_prompt: bool = True
    tools: Optional[list[dict[str, Any]]] = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Optional[Union[str, dict[str, Any]]] = Field(
        default=None, description="'none', 'auto', 'required' or {'type': 'function', ...}")
    parallel_tool_calls: Optional[bool] = None


class TokenizeRequest(OpenAIModel):
    model_config = ConfigDict(json_schema_extra={"anyOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}}}]})

    model: Optional[str] = Field(default=None, max_length=512)
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = Field(default=None, min_length=1,
                                                  max_length=MAX_MESSAGES)
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _prompt_or_messages(self):
        if self.prompt is None and self.messages is None:
            raise PydanticCustomError("missing", "one of prompt or messages is required",
                                      {"field": "prompt"})
        return self


class DetokenizeRequest(OpenAIModel):
    model: Optional[str] = Field(default=None, max_length=512)
    tokens: list[TokenId] = Field(max_length=MAX_PROMPT_TOKENS_LIST)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def deadlines(body: SamplingFields, headers) -> dict:
    """The request's deadlines as AsyncEngine.generate takes them: the body's
    `slo_ttft_ms` / `slo_tpot_ms`, and the gateway header `x-slo-ttft-ms` when the body
    gives no TTFT target. A header that is not a number in (0, a day] is a ValueError
    naming it."""
    ttft = getattr(body, "slo_ttft_ms", None)  # bodies without the fields: the header only
    text = headers.get(SLO_TTFT_HEADER)
    if ttft is None and text is not None:
        try:
            ttft = float(text)
        except ValueError:
            ttft = None
        if ttft is None or not 0 < ttft <= MAX_SLO_MS:
            raise ValueError(f"{SLO_TTFT_HEADER}: must be a number of milliseconds in "
                             f"(0, {MAX_SLO_MS:.0f}], got {text!r}")
    return {"slo_ttft_ms": ttft, "slo_tpot_ms": getattr(body, "slo_tpot_ms", None)}


def now() -> int:
    return int(time.time())
