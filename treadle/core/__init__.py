"""Scheduling and KV-cache bookkeeping in pure Python: never imports torch."""
