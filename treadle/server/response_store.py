"""`ResponseStore`: the Responses API's stored responses, per tenant, in memory (what
`previous_response_id`, GET and DELETE /v1/responses/{id} read)."""

from __future__ import annotations

import threading
from collections import OrderedDict


class ResponseStore:
    """Stored responses: per tenant, the most recent `capacity` (least recently used
    evicted first). Thread-safe; nothing leaves the process."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._tenants: dict[str, OrderedDict[str, dict]] = {}
        self._lock = threading.Lock()

    def put(self, tenant: str, response_id: str, record: dict) -> None:
        with self._lock:
            entries = self._tenants.setdefault(tenant, OrderedDict())
            entries[response_id] = record
            entries.move_to_end(response_id)
            while len(entries) > self.capacity:
                entries.popitem(last=False)

    def get(self, tenant: str, response_id: str) -> dict | None:
        with self._lock:
            entries = self._tenants.get(tenant)
            if entries is None or response_id not in entries:
                return None
            entries.move_to_end(response_id)
            return entries[response_id]

    def delete(self, tenant: str, response_id: str) -> bool:
        with self._lock:
            entries = self._tenants.get(tenant)
            return entries is not None and entries.pop(response_id, None) is not None
