"""The KV cache's bookkeeping in the engine core: the block pool, prefix hashes, the KV
specs (full attention, sliding window, H2O eviction; the cache dtype), one small manager
per spec behind one interface, and the KV cache manager the scheduler uses, which
composes them. Pure Python: no torch, no tensors (the worker holds those).
"""
