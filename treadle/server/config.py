"""`ServerConfig`: the options of the HTTP server in front of the engine (`treadle serve`).

Owns the server's knobs (bind address, keys, overload bounds, LoRA and tool options, the
Responses store, the dashboard and tracing), each a field with a one-line help text from
which `treadle serve` generates its flags (treadle.config.add_dataclass_arguments), and
their validation. It imports nothing of the server's dependencies (FastAPI, uvicorn), so
the command line can build it before the server starts; the engine's own options live in
treadle/config.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP server in front of the engine (`treadle serve`)."""

    host: str = field(default="127.0.0.1", metadata=_help("Address to bind"))
    port: int = field(default=8000, metadata=_help("Port to bind"))
    served_model_name: str | None = field(default=None, metadata=_help(
        "Model name in the API; the Hub id, or the checkpoint folder's name (a .gguf file's "
        "stem), when not given"))
    api_key: list[str] | None = field(default=None, metadata=_help(
        "Accept this Bearer key on /v1/* (repeatable); no keys means an open server"))
    api_keys_file: str | None = field(default=None, metadata=_help(
        "YAML/JSON list of {key, tenant, weight}: keys with tenant names and weights"))
    max_waiting_requests: int = field(default=512, metadata=_help(
        "Requests accepted and not yet started beyond which new ones get 503"))
    max_waiting_tokens: int = field(default=1_000_000, metadata=_help(
        "Prompt tokens waiting beyond which new requests get 503"))
    tenant_max_concurrent_requests: int = field(default=256, metadata=_help(
        "Requests in flight per tenant beyond which new ones get 429"))
    max_queue_delay: float = field(default=20.0, metadata=_help(
        "Refuse (503 with Retry-After) a request whose predicted wait for the engine "
        "exceeds this many seconds, predicted from the work already admitted and the "
        "engine's measured time per token; per priority under the priority policy (0: no "
        "bound; the default leaves a 60 s client timeout 40 s for the answer)"))
    tenant_tokens_per_minute: int = field(default=0, metadata=_help(
        "Prompt + max_tokens per tenant per minute (0: unlimited)"))
    max_request_body_bytes: int = field(default=8 * 1024**2, metadata=_help(
        "Largest accepted request body"))
    body_read_timeout_s: float = field(default=30.0, metadata=_help(
        "A request body that stops arriving for this long gets 408 (a body shorter than "
        "its Content-Length no longer holds the connection)"))
    max_header_bytes: int = field(default=64 * 1024, metadata=_help(
        "Largest request head (request line and headers) accepted; larger gets 431"))
    shutdown_timeout: float = field(default=30.0, metadata=_help(
        "Seconds in-flight requests may finish after SIGTERM before they are aborted"))
    lora_modules: list[str] | None = field(default=None, metadata=_help(
        "LoRA adapters to serve from the start, as name=path (or JSON {\"name\", \"path\"}); "
        "a request selects one by its model field (needs --enable-lora)"))
    enable_lora_runtime_updates: bool = field(default=False, metadata=_help(
        "Allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter"))
    tool_call_parser: str | None = field(default=None, metadata=_help(
        "How tool calls are read out of generated text with tool_choice 'auto': hermes, "
        "llama3_json, mistral or qwen"))
    enable_auto_tool_choice: bool = field(default=False, metadata=_help(
        "Allow tool_choice 'auto' (the model decides; needs --tool-call-parser)"))
    responses_store_size: int = field(default=1000, metadata=_help(
        "Responses API: stored responses kept per tenant for previous_response_id (LRU)"))
    dashboard: bool = field(default=True, metadata=_help(
        "Serve the live dashboard at /dashboard, updated over server-sent events"))
    dashboard_interval: float = field(default=1.0, metadata=_help(
        "Seconds between two dashboard updates (0.1 to 60)"))
    request_timelines: int = field(default=1000, metadata=_help(
        "Finished requests whose timeline GET /v1/requests/{id} keeps (0: live ones only)"))
    recorded_steps: int = field(default=2048, metadata=_help(
        "Recent engine steps kept in memory for the dashboard's step timeline"))
    otlp_traces_endpoint: str | None = field(default=None, metadata=_help(
        "Send one OpenTelemetry span per request to this OTLP/HTTP URL (e.g. "
        "http://127.0.0.1:4318/v1/traces; needs pip install 'treadle[otel]')"))

    def __post_init__(self) -> None:
        for name in ("max_waiting_requests", "max_waiting_tokens",
                     "tenant_max_concurrent_requests", "max_request_body_bytes",
                     "responses_store_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.body_read_timeout_s > 0:
            raise ValueError(f"body_read_timeout_s must be > 0, got {self.body_read_timeout_s}")
        if self.max_header_bytes < 1024:
            raise ValueError(f"max_header_bytes must be >= 1024, got {self.max_header_bytes}")
        if self.max_queue_delay < 0:
            raise ValueError(f"max_queue_delay must be >= 0 seconds, got {self.max_queue_delay}")
        if self.tenant_tokens_per_minute < 0:
            raise ValueError("tenant_tokens_per_minute must be >= 0")
        if not 0.1 <= self.dashboard_interval <= 60:
            raise ValueError(f"dashboard_interval must be in [0.1, 60] seconds, got "
                             f"{self.dashboard_interval}")
        if self.request_timelines < 0:
            raise ValueError(f"request_timelines must be >= 0, got {self.request_timelines}")
        if self.recorded_steps < 1:
            raise ValueError(f"recorded_steps must be >= 1, got {self.recorded_steps}")
        endpoint = self.otlp_traces_endpoint
        if endpoint is not None and not re.match(r"https?://[^/\s]+", endpoint):
            raise ValueError("otlp_traces_endpoint must be an http:// or https:// URL (OTLP "
                             f"over HTTP), got {endpoint!r}")
        if self.shutdown_timeout < 0:
            raise ValueError("shutdown_timeout must be >= 0")
        parsers = ("hermes", "llama3_json", "mistral", "qwen")  # server/tool_parsers
        if self.tool_call_parser is not None and self.tool_call_parser not in parsers:
            raise ValueError(f"tool_call_parser must be one of {', '.join(parsers)}, "
                             f"got {self.tool_call_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser")
