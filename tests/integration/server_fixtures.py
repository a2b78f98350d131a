"""Start `treadle serve` on a tiny model for tests (see treadle/measure/launch.py)."""

from __future__ import annotations

from contextlib import contextmanager

from treadle.measure.launch import free_port, launched_server

__all__ = ["free_port", "running_server"]


@contextmanager
def running_server(model_dir: str, *extra: str, startup_timeout: float = 120.0):
    """Yields (base_url, process) of a float32 server named "tiny"."""
    with launched_server(["--model", model_dir, "--dtype", "float32",
                          "--served-model-name", "tiny", *extra],
                         startup_timeout=startup_timeout) as served:
        yield served
