"""Does compiling a grammar stall the other streams? (issue: compiling never stalls others)

Serves a model, runs one long plain stream (greedy, ignore_eos), and measures its inter-
token gaps while each of the heaviest grammars the server accepts is requested (a schema
of N optional integer properties, an enum of M strings, both made unique per repeat, so
each is a compile-cache miss): a `compile` window spans the compile as the server logs
it (its debug line gives the monotonic start and end, the clock this process reads).
Two baselines, each window as long as the compile's it follows:

- `control`: the same request without its grammar, the window opening when it is sent.
  A compile window's edge gaps hold work that is not the compile: the one in flight when
  it opens, the request's arrival; the one it closes in, the request's prefill joining
  the stream's step. The control window holds the same two (its arrival and prefill),
  and its decode steps besides, but no compile: the ratio to it is what compiling adds.
- `quiet`: nothing but the stream.

The first constrained request of the process builds the grammar compilers (a one-time
cost, done before measuring). The figures are the ratios of the p90 gap in compile
windows to the p90 gap in each baseline's windows, over `--repeats` repeats (target: the
control ratio within 1.2x).

    python benchmarks/grammar_stall.py --model PATH [--repeats 5] [--output stall.json]
"""

from __future__ import annotations

import argparse
import bisect
import json
import re
import threading
import time

import httpx

from treadle.measure.launch import launched_server


def heavy_bodies(repeat: int, properties: int, enum_values: int) -> dict[str, dict]:
    """The heaviest accepted schemas, unique per repeat (the compile cache never hits)."""
    tag = f"r{repeat}"
    props = {"type": "object", "properties": {
        f"{tag}_p{i}": {"type": "integer"} for i in range(properties)}}
    enum = {"type": "object", "required": ["x"], "properties": {"x": {
        "enum": [f"{tag}_value{i}" for i in range(enum_values)]}}}
    return {f"{properties} optional properties": props, f"enum of {enum_values}": enum}


class Stream:
    """A plain greedy stream whose token arrival times are recorded."""

    def __init__(self, base: str, model: str) -> None:
        self.times: list[float] = []
        self._stop = threading.Event()
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": 8000,
                "temperature": 0, "ignore_eos": True, "stream": True}

        def run() -> None:
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=None) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        self.times.append(time.monotonic())
                    if self._stop.is_set():
                        return
        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def gaps(self, start: float, end: float) -> list[float]:
        """The gaps between tokens that overlap [start, end] (the one a window opens
        in and the one it closes in included: a stall longer than the window is one)."""
        times = self.times[:]
        first = max(0, bisect.bisect_left(times, start) - 1)
        last = bisect.bisect_right(times, end) + 1
        t = times[first:last]
        return [b - a for a, b in zip(t, t[1:])]

    def stop(self) -> None:
        self._stop.set()


def compile_spans(log_path: str) -> list[tuple[float, float]]:
    """The (start, end) monotonic times of each grammar compile the server logged."""
    with open(log_path) as f:
        return [(float(a), float(b)) for a, b in
                re.findall(r"grammar compiled .* \(monotonic ([0-9.]+) to ([0-9.]+)\)", f.read())]


def p90(values: list[float]) -> float:
    values = sorted(values)
    return values[int(0.9 * (len(values) - 1))] if values else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="the served model (default: treadle's)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--properties", type=int, default=420)
    parser.add_argument("--enum-values", type=int, default=15_000)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    served = ["--served-model-name", "m"] + (["--model", args.model] if args.model else [])
    result = {"quiet": [], "control": [], "compile": [], "requests": []}
    with launched_server(served, startup_timeout=600, log_level="DEBUG") as (base, proc):
        warm = {"model": "m", "prompt": "x", "max_tokens": 2,
                "structured_outputs": {"regex": "[a-z]+"}}
        httpx.post(base + "/v1/completions", json=warm, timeout=300).raise_for_status()
        stream = Stream(base, "m")
        time.sleep(3)
        for repeat in range(args.repeats):
            for name, schema in heavy_bodies(repeat, args.properties, args.enum_values).items():
                body = {"model": "m", "max_tokens": 4,
                        "messages": [{"role": "user", "content": "JSON please"}],
                        "response_format": {"type": "json_schema",
                                            "json_schema": {"name": "x", "schema": schema}}}
                t0 = time.monotonic()
                r = httpx.post(base + "/v1/chat/completions", timeout=300, json=body)
                result["requests"].append({"schema": name, "status": r.status_code,
                                           "seconds": round(time.monotonic() - t0, 3)})
                start, end = compile_spans(proc.log_path)[-1]
                gaps = stream.gaps(start, end)
                result["compile"] += gaps
                result["requests"][-1].update(compile_s=round(end - start, 3),
                                              gaps_ms=[round(1e3 * g, 1) for g in gaps])
                time.sleep(0.1)
                length = max(end - start, 0.2)
                plain = {k: v for k, v in body.items() if k != "response_format"}
                t1 = time.monotonic()
                httpx.post(base + "/v1/chat/completions", timeout=300,
                           json=plain).raise_for_status()
                time.sleep(max(0.0, t1 + length - time.monotonic()))
                result["control"] += stream.gaps(t1, t1 + length)
                time.sleep(0.1)
                t2 = time.monotonic()
                time.sleep(length)  # nothing but the stream
                result["quiet"] += stream.gaps(t2, time.monotonic())
        stream.stop()
    windows = ("quiet", "control", "compile")
    summary = {f"p90_{window}_s": p90(result[window]) for window in windows}
    summary["gaps"] = {window: len(result[window]) for window in windows}
    summary["ratio"] = summary["p90_compile_s"] / summary["p90_control_s"]
    summary["ratio_to_quiet"] = summary["p90_compile_s"] / summary["p90_quiet_s"]
    print(json.dumps(summary, indent=1))
    for request in result["requests"]:
        print(request)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"summary": summary, **result}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
