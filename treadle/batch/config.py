"""`BatchConfig`: the Batch API's options (`treadle serve` flags), and completion windows.

Owns the knobs of /v1/files and /v1/batches (where their state lives, the bounds a tenant
meets, how many lines run at once), each a field with a one-line help text from which
`treadle serve` generates its flags (treadle.config.add_dataclass_arguments), and the
completion-window grammar. Imports nothing of the server; decides nothing at run time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from treadle.paths import data_dir

WINDOW_PATTERN = r"^(?:[1-9][0-9]{0,5}s|[1-9][0-9]{0,3}m|[1-9][0-9]{0,2}h)$"
"""A completion window: OpenAI's "24h", or any whole number of seconds (up to 999999),
minutes (up to 9999) or hours (up to 999). Every value the pattern admits is accepted, so
the published schema is exact."""
_UNIT_S = {"s": 1, "m": 60, "h": 3600}


def window_seconds(window: str) -> int:
    """Seconds of a completion window ("24h" -> 86400); ValueError naming the grammar."""
    if not isinstance(window, str) or not re.match(WINDOW_PATTERN, window):
        raise ValueError(f"completion_window: {window!r} is not a duration such as '24h', "
                         "'90m' or '3600s'")
    return int(window[:-1]) * _UNIT_S[window[-1]]


def default_state_dir() -> Path:
    """Where the Batch API keeps its state when --state-dir is not given."""
    return data_dir() / "batch"


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class BatchConfig:
    """The Batch API of `treadle serve` (docs/batch.md)."""

    batch_api: bool = field(default=True, metadata=_help(
        "Serve the OpenAI Batch API (/v1/files, /v1/batches), its state kept in --state-dir"))
    state_dir: str | None = field(default=None, metadata=_help(
        "Where files, batches and each line's outcome are kept (SQLite + files), resumed "
        "after a restart; default: $XDG_DATA_HOME/treadle/batch or "
        "~/.local/share/treadle/batch"))
    batch_max_file_bytes: int = field(default=200 * 1024**2, metadata=_help(
        "Largest file /v1/files accepts (OpenAI's bound: 200 MB)"))
    batch_max_lines: int = field(default=50_000, metadata=_help(
        "Most requests one batch file may hold (OpenAI's bound: 50,000)"))
    batch_max_open_per_tenant: int = field(default=16, metadata=_help(
        "Unfinished batches one tenant may have; more get 429"))
    batch_max_concurrent_lines: int = field(default=0, metadata=_help(
        "Batch lines handed to the engine at once (0: twice max_num_seqs, per replica, "
        "enough to fill every slot while finished lines are replaced)"))

    def __post_init__(self) -> None:
        for name in ("batch_max_file_bytes", "batch_max_lines", "batch_max_open_per_tenant"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.batch_max_concurrent_lines < 0:
            raise ValueError("batch_max_concurrent_lines must be >= 0 (0: automatic), got "
                             f"{self.batch_max_concurrent_lines}")

    @property
    def state_path(self) -> Path:
        """The state directory this config names (the default when none)."""
        return Path(self.state_dir).expanduser() if self.state_dir else default_state_dir()

    def window(self, max_num_seqs: int) -> int:
        """Lines in flight at once for an engine of `max_num_seqs` slots."""
        return self.batch_max_concurrent_lines or 2 * max_num_seqs
