"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) on
the same serving object as the OpenAI routes (server/serving.py): one path for keys and
tenants, limits, admission, tool grammars and aborts on disconnect.

protocol.py: the request bodies; convert.py: a request as the chat request treadle
serves; reply.py: the message body and the streamed events; messages.py: the two
endpoints. Errors under /v1/messages are in Anthropic's shape (server/errors.py), and a
key may come in `x-api-key` (server/middleware.py). docs/anthropic_api.md says what is
served and what is refused.
"""
