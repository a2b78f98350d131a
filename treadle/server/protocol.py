"""Request and response bodies of the OpenAI-compatible API (pydantic), with their bounds.

Owns the wire format: field names and types follow the OpenAI API plus vLLM's sampling
extensions and `priority`. Every field is bounded here, so a violation is a 400 naming
the field before anything reaches the engine. It does not tokenize or talk to the engine.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_N = 16
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_PROMPT_TOKENS_LIST = 1_000_000
MAX_TOKEN_ID = 2**31 - 1
MAX_MESSAGES = 1024


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIModel(BaseModel):
    # Unknown fields are ignored, as the OpenAI API does (clients send extras).
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class SamplingFields(OpenAIModel):
    """Fields shared by completions and chat completions."""

    model: Optional[str] = Field(default=None, max_length=512)
    max_tokens: Optional[int] = Field(default=None, ge=1, le=1_000_000)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, le=1_000_000)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    seed: Optional[int] = Field(default=None, ge=0, le=2**63 - 1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = Field(default=None, max_length=MAX_STOP_STRINGS)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, le=1_000_000)
    logit_bias: Optional[dict[str, float]] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    priority: int = Field(default=0, ge=-1_000_000, le=1_000_000)
    user: Optional[str] = Field(default=None, max_length=256)
    speculative: bool = True
    """false: no speculative decoding for this request (treadle extension)."""

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, value):
        if value is None:
            return value
        stops = [value] if isinstance(value, str) else value
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        for s in stops:
            if not s or len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"each stop string must have 1 to {MAX_STOP_STRING_CHARS} "
                                 f"characters, got {len(s)}")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _bounded_stop_ids(cls, value):
        if value is not None and any(not 0 <= t <= MAX_TOKEN_ID for t in value):
            raise ValueError("stop_token_ids must be non-negative token ids")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bounded_logit_bias(cls, value):
        if value is None:
            return value
        if len(value) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(value)}")
        for key, bias in value.items():
            if not key.isdigit() or int(key) > MAX_TOKEN_ID:
                raise ValueError(f"keys must be token ids, got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"biases must be in [-100, 100], got {bias}")
        return value

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: bool = False
    logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)
    suffix: Optional[str] = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) != 1:
                raise ValueError("batched prompts are not supported: send one prompt per request")
            value = value[0]
        if isinstance(value, list):
            if len(value) > MAX_PROMPT_TOKENS_LIST:
                raise ValueError(f"at most {MAX_PROMPT_TOKENS_LIST} prompt token ids")
            if any(not 0 <= t <= MAX_TOKEN_ID for t in value):
                raise ValueError("prompt token ids must be non-negative")
        return value


class ChatMessage(OpenAIModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[dict[str, Any]], None] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1, le=1_000_000)
    add_generation_prompt: bool = True


class TokenizeRequest(OpenAIModel):
    model: Optional[str] = Field(default=None, max_length=512)
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = Field(default=None, min_length=1,
                                                  max_length=MAX_MESSAGES)
    add_special_tokens: bool = True


class DetokenizeRequest(OpenAIModel):
    model: Optional[str] = Field(default=None, max_length=512)
    tokens: list[int] = Field(max_length=MAX_PROMPT_TOKENS_LIST)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def now() -> int:
    return int(time.time())
