"""Start `treadle serve` on a tiny model for tests (see treadle/measure/launch.py), and the
tiny demo model the server tests share."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from treadle.measure.launch import free_port, launched_server
from treadle.models.demo import write_demo_model

__all__ = ["TINY_DEMO", "free_port", "running_server", "write_tiny_demo"]

TINY_DEMO = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                 initializer_range=0.2)
"""The demo model's shape in the server tests: two layers of width 64, 512 positions."""


def write_tiny_demo(folder: Path, seed: int = 5) -> str:
    """The tiny demo checkpoint (TINY_DEMO, random weights of `seed`) written in `folder`."""
    return str(write_demo_model(Path(folder) / "m", seed=seed, config_overrides=TINY_DEMO))


@contextmanager
def running_server(model_dir: str, *extra: str, startup_timeout: float = 120.0):
    """Yields (base_url, process) of a float32 server named "tiny"."""
    with launched_server(["--model", model_dir, "--dtype", "float32",
                          "--served-model-name", "tiny", *extra],
                         startup_timeout=startup_timeout) as served:
        yield served
