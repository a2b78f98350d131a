"""The adapters one engine knows: registration (checked against the model), lookup by name,
removal, and ids that keep their meaning.

Owns the name -> LoRARequest map that requests are resolved against (the server looks a
request's `model` up here), and every id ever registered with the adapter it meant: an id
is never reused for another adapter, because it keys the worker's adapter caches and the
root of the prefix-cache hash chain (core/kv/hashing.py). Registering an adapter
checks its files against the model the worker reported (treadle/lora.py: modules, layers,
ranks, shapes) and raises LoRAError naming what does not fit. Thread-safe: the server's
event loop and the engine thread both use it. No torch; it never loads tensors (the
worker does, when a step first needs the adapter).
"""

from __future__ import annotations

import threading

from treadle.lora import AdapterSpec, LoRAError, LoRARequest, inspect_adapter


class LoRARegistry:
    """Adapters by name and id."""

    def __init__(self, module_shapes: dict[str, tuple[int, int]], num_layers: int,
                 max_lora_rank: int) -> None:
        self.module_shapes = dict(module_shapes)
        self.num_layers = num_layers
        self.max_lora_rank = max_lora_rank
        self._lock = threading.Lock()
        self._by_name: dict[str, LoRARequest] = {}
        self._specs: dict[int, AdapterSpec] = {}
        self._identity: dict[int, tuple[str, str]] = {}
        """Every id ever registered -> (name, path)."""
        self._next_id = 1

    def add(self, lora: LoRARequest) -> AdapterSpec:
        """Register an adapter (a no-op for one registered as it is). Raises LoRAError when
        its files do not fit the model, its id meant another adapter, or its name is
        taken by another id."""
        with self._lock:
            known = self._by_name.get(lora.lora_name)
            if known == lora:
                return self._specs[lora.lora_int_id]
            self._check_names(lora, known)
        spec = inspect_adapter(lora.lora_path, self.module_shapes, self.num_layers,
                               self.max_lora_rank)  # reads files: outside the lock
        with self._lock:
            known = self._by_name.get(lora.lora_name)
            if known == lora:
                return self._specs[lora.lora_int_id]
            self._check_names(lora, known)
            self._by_name[lora.lora_name] = lora
            self._specs[lora.lora_int_id] = spec
            self._identity[lora.lora_int_id] = (lora.lora_name, lora.lora_path)
            self._next_id = max(self._next_id, lora.lora_int_id + 1)
        return spec

    def _check_names(self, lora: LoRARequest, known: LoRARequest | None) -> None:
        if known is not None:
            raise LoRAError(f"adapter name {lora.lora_name!r} is already lora_int_id "
                            f"{known.lora_int_id} at {known.lora_path!r}")
        identity = self._identity.get(lora.lora_int_id)
        if identity is not None and identity != (lora.lora_name, lora.lora_path):
            raise LoRAError(f"lora_int_id {lora.lora_int_id} already means adapter "
                            f"{identity[0]!r} at {identity[1]!r} in this engine; give "
                            "another adapter another id")

    def inspect(self, path: str) -> AdapterSpec:
        """Check the adapter at `path` against the model without registering it
        (LoRAError naming what does not fit)."""
        return inspect_adapter(path, self.module_shapes, self.num_layers, self.max_lora_rank)

    def remove(self, name: str) -> LoRARequest | None:
        """Forget an adapter by name (its id stays taken); the removed one, or None.
        Requests already running with it finish with it."""
        with self._lock:
            lora = self._by_name.pop(name, None)
            if lora is not None:
                self._specs.pop(lora.lora_int_id, None)
            return lora

    def get(self, name: str) -> LoRARequest | None:
        with self._lock:
            return self._by_name.get(name)

    def spec(self, lora_int_id: int) -> AdapterSpec | None:
        with self._lock:
            return self._specs.get(lora_int_id)

    def list(self) -> list[LoRARequest]:
        with self._lock:
            return sorted(self._by_name.values(), key=lambda r: r.lora_int_id)

    def new_id(self) -> int:
        """An id never used in this engine, reserved for the caller."""
        with self._lock:
            self._next_id += 1
            return self._next_id - 1

    def check(self, lora: LoRARequest) -> str | None:
        """Why a request cannot run with this adapter (registering it if new), or None."""
        try:
            self.add(lora)
        except LoRAError as exc:
            return f"lora_request: {exc}"
        return None
