"""KV-cache events in vLLM's wire format (docs/kv_events.md).

The engine side: `recorder` turns the prefix cache's changes (core/kv/events.py's hook)
into vLLM's events, `publisher` sends them as numbered batches on a ZMQ PUB socket and
replays missed ones from a bounded buffer on a ROUTER socket, `engine` is what the engine
core attaches when `kv_events_endpoint` is set. The router side: `subscriber` follows one
publisher (gaps filled by replay), `index` keeps which blocks each replica holds and
answers how long a prompt's cached prefix is there. `wire` is the format; the options are
treadle/config/kv_events.py. Nothing here imports pyzmq until a socket is made.
"""
