"""Prefix hashes of KV blocks: the chain every layer group, the P/D transfer and the
simulator's routers key cached blocks by.

Prefix hash of full block i: BLAKE2b-128 over (hash of block i-1, the block's token ids
as little-endian int64). The chain starts from a hash of the request's `cache_salt` and its
LoRA adapter's id (`root_hash`), so requests with different salts (tenants) or different
adapters (or one with an adapter and one without) never share a block. Pure functions of
token ids: no pool, no request state, no torch.
"""

from __future__ import annotations

import hashlib
from array import array

_HASH_BYTES = 16


def prefix_salt(tenant: str | None, cache_salt: str | None) -> str | None:
    """A request's prefix-cache salt: its tenant's, and its own `cache_salt` (vLLM's
    field) when it gives one, so that only requests of one tenant with one salt share
    cached blocks."""
    if cache_salt is None:
        return tenant
    return f"{tenant or ''}\x00cache-salt\x00{cache_salt}"


def root_hash(cache_salt: str | None, lora_int_id: int | None = None) -> bytes:
    """The hash a request's chain starts from (its salt and adapter)."""
    salt = b"" if cache_salt is None else cache_salt.encode("utf-8")
    if lora_int_id is None:
        head = b"treadle-prefix-v1\x00"
    else:  # an id always means one adapter in an engine (treadle/lora.py)
        head = b"treadle-prefix-lora-v1\x00" + lora_int_id.to_bytes(8, "little")
    return hashlib.blake2b(head + salt, digest_size=_HASH_BYTES).digest()


def hash_block(parent_hash: bytes, token_ids: list[int]) -> bytes:
    """Chained hash of one full block of token ids."""
    encoded = array("q", token_ids)
    if encoded.itemsize != 8:  # pragma: no cover - every supported platform has 8-byte q
        raise RuntimeError("array('q') is not 64-bit on this platform")
    if array("H", [1]).tobytes() != b"\x01\x00":  # big-endian host: normalise
        encoded.byteswap()
    return hashlib.blake2b(parent_hash + encoded.tobytes(), digest_size=_HASH_BYTES).digest()
