"""The server's routes (OpenAI's, and Anthropic's Messages API): parse, call the serving
object, return.

Owns the URL table of the generating and utility endpoints (with the two probes: /health
for liveness, /ready for readiness) (the LoRA runtime routes
are server/lora_routes.py's, the dashboard's server/dashboard.py's). Each route is a
few lines: FastAPI parses and validates the body (a 400 naming the field, via
server/errors.py), the route hands it to the app's OpenAIServing (server/serving.py)
or to the endpoint's module with it, and returns what that answers. No decision is
made here: adding an endpoint is its module plus one route.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from fastapi import FastAPI, Request

from treadle.server import protocol, responses_api
from treadle.server.anthropic import messages as anthropic_messages
from treadle.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from treadle.server.chat import create_chat_completion
from treadle.server.completions import create_completion
from treadle.server.responses_api import ResponsesRequest
from treadle.server.serving import serving_of


@dataclass(frozen=True)
class Route:
    """One line of a route table: FastAPI's add_api_route arguments."""

    method: str
    path: str
    endpoint: Callable
    response_class: type | None = None
    response_model: type | None = None
    openapi_extra: dict | None = None
    """Replaces parts of the route's published operation (server/batch_routes.py: the
    upload's body is multipart, which FastAPI does not say of a form model)."""


def add_routes(app: FastAPI, routes: tuple[Route, ...]) -> None:
    """Add a table's routes to the app itself, in order (not through an included
    router: FastAPI resolves those lazily, and the 405 handler of server/errors.py reads
    the app's own routes for the Allow header)."""
    for route in routes:
        options = {name: value for name in ("response_class", "response_model", "openapi_extra")
                   if (value := getattr(route, name)) is not None}
        app.add_api_route(route.path, route.endpoint, methods=[route.method], **options)


async def health(request: Request):
    return serving_of(request).health()


async def ready(request: Request):
    return serving_of(request).ready()


async def metrics(request: Request):
    return await serving_of(request).metrics()


async def models(request: Request):
    return serving_of(request).models(request)


async def tokenize(body: protocol.TokenizeRequest, request: Request):
    return await serving_of(request).tokenize(body, request)


async def detokenize(body: protocol.DetokenizeRequest, request: Request):
    return await serving_of(request).detokenize(body, request)


async def completions(body: protocol.CompletionRequest, request: Request):
    return await create_completion(serving_of(request), body, request)


async def chat_completions(body: protocol.ChatCompletionRequest, request: Request):
    return await create_chat_completion(serving_of(request), body, request)


async def create_response(body: ResponsesRequest, request: Request):
    return await responses_api.create_response(serving_of(request), body, request)


async def create_message(body: MessagesRequest, request: Request):
    return await anthropic_messages.create_message(serving_of(request), body, request)


async def count_message_tokens(body: CountTokensRequest, request: Request):
    return await anthropic_messages.count_tokens(serving_of(request), body, request)


async def get_response(response_id: str, request: Request):
    return responses_api.get_response(serving_of(request), response_id, request)


async def delete_response(response_id: str, request: Request):
    return responses_api.delete_response(serving_of(request), response_id, request)


ROUTES = (
    Route("GET", "/health", health),
    Route("GET", "/ready", ready),
    Route("GET", "/metrics", metrics),
    Route("GET", "/v1/models", models),
    Route("POST", "/tokenize", tokenize),
    Route("POST", "/detokenize", detokenize),
    Route("POST", "/v1/completions", completions),
    Route("POST", "/v1/chat/completions", chat_completions),
    Route("POST", "/v1/responses", create_response),
    Route("GET", "/v1/responses/{response_id}", get_response),
    Route("DELETE", "/v1/responses/{response_id}", delete_response),
    Route("POST", "/v1/messages", create_message),
    Route("POST", "/v1/messages/count_tokens", count_message_tokens),
)
"""The OpenAI endpoints, then Anthropic's Messages API, in the order the schema lists them."""
