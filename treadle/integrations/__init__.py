"""treadle inside the stacks people deploy (Ray Serve: ray_serve/). Each subpackage
imports its third-party library only when it is used, so importing this package costs
nothing. vLLM's KV-event wire format, which the engine itself speaks, is treadle/kv_events.
"""
