"""Where treadle keeps files it makes for itself: a cache (the demo model, built kernels),
and data that must outlive the process (the Batch API's state, treadle/batch)."""

from __future__ import annotations

import os
import pathlib


def cache_dir() -> pathlib.Path:
    """`$TREADLE_CACHE_DIR` when set, else `~/.cache/treadle`."""
    return pathlib.Path(os.environ.get("TREADLE_CACHE_DIR")
                        or pathlib.Path.home() / ".cache" / "treadle").expanduser()


def data_dir() -> pathlib.Path:
    """`$XDG_DATA_HOME/treadle` when XDG_DATA_HOME is set, else `~/.local/share/treadle`:
    what must survive a restart (unlike the cache, nothing here can be made again)."""
    root = os.environ.get("XDG_DATA_HOME") or pathlib.Path.home() / ".local" / "share"
    return (pathlib.Path(root) / "treadle").expanduser()
