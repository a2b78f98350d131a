"""API keys and tenants: who is calling, decided from the key and never from the body.

Owns loading keys (`--api-key`, repeatable, and `--api-keys-file`, a YAML/JSON list of
{key, tenant, weight, models}) and the constant-time check of the key a request
presents (a Bearer token, or Anthropic's `x-api-key` header). `models`
limits a key to those served model names (the base model's and adapters'); a key without
it may use every model. A request's tenant
feeds the `fair` scheduling policy and becomes its prefix-cache salt, so tenants never
share KV blocks. With no keys configured the server is open and every request belongs
to the tenant "default".
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path

import yaml

DEFAULT_TENANT = "default"


@dataclass(frozen=True)
class Tenant:
    name: str
    weight: float = 1.0
    models: frozenset[str] | None = None
    """The served model names this key may use and see; None: every one."""

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models


class AuthError(Exception):
    """The caller did not present a valid key."""


class KeyRing:
    """The configured keys and the tenant each belongs to."""

    def __init__(self, keys: dict[str, Tenant]) -> None:
        self._keys = [(key.encode("utf-8"), tenant) for key, tenant in keys.items()]

    @classmethod
    def from_options(cls, api_keys: list[str] | None, keys_file: str | None) -> "KeyRing":
        keys: dict[str, Tenant] = {}
        for i, key in enumerate(api_keys or []):
            if not key:
                raise ValueError("api_key must not be empty")
            keys[key] = Tenant(f"key{i}")
        if keys_file:
            entries = yaml.safe_load(Path(keys_file).read_text())
            if isinstance(entries, dict):
                entries = entries.get("keys", [])
            if not isinstance(entries, list):
                raise ValueError(f"{keys_file}: expected a list of {{key, tenant, weight}}")
            for n, entry in enumerate(entries):
                if not isinstance(entry, dict) or not entry.get("key") or not entry.get("tenant"):
                    raise ValueError(f"{keys_file}: entry {n} needs 'key' and 'tenant'")
                weight = float(entry.get("weight", 1.0))
                if weight <= 0:
                    raise ValueError(f"{keys_file}: entry {n} weight must be > 0, got {weight}")
                models = entry.get("models")
                if models is not None and (not isinstance(models, list) or not all(
                        isinstance(m, str) and m for m in models)):
                    raise ValueError(f"{keys_file}: entry {n} models must be a list of "
                                     f"model names, got {models!r}")
                keys[str(entry["key"])] = Tenant(
                    str(entry["tenant"]), weight,
                    None if models is None else frozenset(models))
        return cls(keys)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def tenants(self) -> dict[str, float]:
        """Tenant name -> weight."""
        return {tenant.name: tenant.weight for _, tenant in self._keys}

    def authenticate(self, authorization: str | None, api_key: str | None = None) -> Tenant:
        """The tenant of an `Authorization: Bearer KEY` header, or else of an
        `x-api-key: KEY` header (Anthropic's clients send that); AuthError if neither
        holds a valid key."""
        if not self.enabled:
            return Tenant(DEFAULT_TENANT)
        if authorization and authorization.startswith("Bearer "):
            presented = authorization[len("Bearer "):].strip().encode("utf-8")
        elif api_key:
            presented = api_key.strip().encode("utf-8")
        else:
            raise AuthError("missing API key: send 'Authorization: Bearer <api key>' or "
                            "'x-api-key: <api key>'")
        found = None
        for key, tenant in self._keys:  # compare with every key: timing reveals nothing
            if hmac.compare_digest(presented, key):
                found = tenant
        if found is None:
            raise AuthError("invalid api key")
        return found
