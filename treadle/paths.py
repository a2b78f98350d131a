"""Where treadle keeps files it makes for itself (the demo model, built kernels)."""

from __future__ import annotations

import os
import pathlib


def cache_dir() -> pathlib.Path:
    """`$TREADLE_CACHE_DIR` when set, else `~/.cache/treadle`."""
    return pathlib.Path(os.environ.get("TREADLE_CACHE_DIR")
                        or pathlib.Path.home() / ".cache" / "treadle").expanduser()
