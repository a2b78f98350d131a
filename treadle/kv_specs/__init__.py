"""What a KV cache is declared to be, below everything that uses it: each layer group's
spec (full attention, sliding window, heavy-hitter eviction, its cache dtype and layout,
its capabilities: `specs`) and heavy-hitter eviction's budget (`eviction`). Read by the
configuration's combination checks (treadle/compat.py), the engine core's KV managers
(core/kv/), the worker's cache (worker/kv_cache.py) and the server's limits. Pure Python:
no torch, nothing of treadle imported.
"""
