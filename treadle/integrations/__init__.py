"""treadle inside the stacks people deploy: KV events in vLLM's format (kv_events/), and
the other integrations beside it. Each subpackage imports its third-party library only
when it is used, so importing this package costs nothing.
"""
