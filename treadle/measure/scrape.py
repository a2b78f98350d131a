"""Reading one figure from a treadle server's `/metrics` (benchmarks and tests).

Owns `metric_total`: the sum of a `treadle:*` metric's samples over every label set that
contains a given label text (every replica, every reason), its `_total` counter name
included, so callers name a counter as they name a gauge.
"""

from __future__ import annotations

import httpx


def metric_total(base: str, name: str, labels: str = "") -> float:
    """Sum of `treadle:<name>` (or `treadle:<name>_total`) samples at `base`/metrics whose
    label text contains `labels` ('' for all)."""
    total = 0.0
    for line in httpx.get(base + "/metrics", timeout=30).text.splitlines():
        key = line.split(" ")[0]
        if key.split("{")[0] in (f"treadle:{name}", f"treadle:{name}_total") and labels in key:
            total += float(line.rsplit(" ", 1)[1])
    return total
