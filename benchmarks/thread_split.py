"""Each thread's time in a perf profile, by shared object: `python
benchmarks/thread_split.py FILE`.

FILE is the text of `perf script -F tid,time,ip,sym,dso` over a sampling profile taken at
a fixed rate (`perf record -e cpu-clock -F 1000 [-g] -- treadle bench throughput ...`);
with call graphs (-g) a sample's first frame is where it was. Counts each thread's
samples by shared object (treadle's C kernels, whatever their build's name, as
`kernels`; libgomp, where OpenMP's threads wait; libpython; the OS as
`[kernel.kallsyms]`) and converts them to seconds at the sampling rate, over the whole
recording or its last `--last-seconds` (an engine run without its start-up). With two
threads on two cores, what one thread spends outside the kernels while the other waits
in libgomp is the run's serial part: docs/benchmarks.md, "Round 20", came from it:

    perf record -e cpu-clock -F 1000 -g -o run.data -- treadle bench throughput ...
    perf script -i run.data -F tid,time,ip,sym,dso > run.txt
    python benchmarks/thread_split.py run.txt --last-seconds 30
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

KERNELS = "kernels"
"""The group name of treadle's C kernel libraries (kernels-<isa>-<hash>.so)."""

_HEADER = re.compile(r"^\s*(\d+)\s+(\d+\.\d+):\s*(.*)$")
_FRAME = re.compile(r"^\s*([0-9a-fA-F]+)\s+(.*?)\s*\(([^()]*)\)\s*$")


@dataclass(frozen=True)
class Sample:
    tid: int
    time: float
    symbol: str
    dso: str


def _dso_group(path: str) -> str:
    name = path.rsplit("/", 1)[-1]
    return KERNELS if name.startswith("kernels-") and ".so" in name else name


def _frame(text: str) -> tuple[str, str] | None:
    match = _FRAME.match(text)
    if match is None:
        return None
    symbol = re.sub(r"\+0x[0-9a-fA-F]+$", "", match.group(2)) or "[unknown]"
    return symbol, _dso_group(match.group(3))


def parse(text: str) -> list[Sample]:
    """The samples of `perf script -F tid,time,ip,sym,dso` output, each at its first
    frame (the line after the header when the profile has call graphs)."""
    samples: list[Sample] = []
    pending: tuple[int, float] | None = None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            tid, time = int(header.group(1)), float(header.group(2))
            frame = _frame(header.group(3)) if header.group(3).strip() else None
            if frame is None:
                pending = (tid, time)
            else:
                samples.append(Sample(tid, time, *frame))
                pending = None
            continue
        if pending is not None and line.strip():
            frame = _frame(line)
            if frame is not None:
                samples.append(Sample(*pending, *frame))
            pending = None
    return samples


def split(samples: list[Sample], frequency: float, last_seconds: float | None = None,
          top_symbols: int = 5) -> dict:
    """{"span_seconds", "threads": {tid: {"seconds", "by_dso": {dso: seconds},
    "top_kernels": {symbol: seconds}}}}, threads by most samples first; with
    last_seconds, only the samples within that long of the last one."""
    if frequency <= 0:
        raise ValueError(f"frequency must be > 0 samples/s, got {frequency}")
    if last_seconds is not None and samples:
        start = max(s.time for s in samples) - last_seconds
        samples = [s for s in samples if s.time >= start]
    span = max(s.time for s in samples) - min(s.time for s in samples) if samples else 0.0
    per_thread: dict[int, Counter] = {}
    kernels: dict[int, Counter] = {}
    for s in samples:
        per_thread.setdefault(s.tid, Counter())[s.dso] += 1
        if s.dso == KERNELS:
            kernels.setdefault(s.tid, Counter())[s.symbol] += 1
    threads = {}
    for tid, by_dso in sorted(per_thread.items(), key=lambda kv: -sum(kv[1].values())):
        threads[tid] = {
            "seconds": sum(by_dso.values()) / frequency,
            "by_dso": {d: n / frequency for d, n in by_dso.most_common()},
            "top_kernels": {k: n / frequency
                            for k, n in kernels.get(tid, Counter()).most_common(top_symbols)},
        }
    return {"span_seconds": span, "threads": threads}


def format_split(result: dict, min_seconds: float = 0.05) -> str:
    lines = [f"span {result['span_seconds']:.2f} s"]
    for tid, thread in result["threads"].items():
        lines.append(f"thread {tid}: {thread['seconds']:.2f} s sampled")
        for dso, seconds in thread["by_dso"].items():
            if seconds >= min_seconds:
                lines.append(f"  {seconds:8.2f} s  {dso}")
        for symbol, seconds in thread["top_kernels"].items():
            lines.append(f"  {seconds:8.2f} s    {KERNELS}: {symbol}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("perf_script", type=Path,
                        help="output of `perf script -F tid,time,ip,sym,dso`")
    parser.add_argument("--frequency", type=float, default=1000.0,
                        help="samples per second per thread, perf record's -F "
                             "(default: %(default)s)")
    parser.add_argument("--last-seconds", type=float, default=None,
                        help="only the samples within this many seconds of the last one")
    parser.add_argument("--top-kernels", type=int, default=5,
                        help="kernel symbols listed per thread (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    args = parser.parse_args(argv)
    result = split(parse(args.perf_script.read_text(errors="replace")), args.frequency,
                   args.last_seconds, args.top_kernels)
    print(json.dumps(result) if args.json else format_split(result))


if __name__ == "__main__":
    main()
