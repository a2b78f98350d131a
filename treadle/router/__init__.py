"""Routing requests among engine replicas (pure Python: no Ray, no torch; docs/replicas.md)."""
