"""`treadle bench dashboard`: what watching the engine costs a served engine.

Owns `served_cost`: the engine-core workload (treadle.measure.workloads.synthetic)
served over HTTP by two `treadle serve` processes launched side by side with the same
options, one with the recorder off (`--no-dashboard --request-timelines 0`) and one with
its defaults, loaded in turn — off, on with nobody watching, on with a dashboard open (a
client reading /dashboard/events, or headless Chromium showing /dashboard) — the order
rotated each repeat so that drift on a shared machine hits each alike.

It reports what it measured (medians, ratios against "off"); it decides nothing. What
the recorder costs the engine thread per step, measured on the recorder itself with no
model, is benchmarks/dashboard_recorder.py (it reaches into the engine's and the server's
internals, so it stands outside the package).
"""

from __future__ import annotations

import asyncio
import statistics
import threading

SYSTEMS = ("off", "on", "open")
"""Recorder off; recorder on, no viewer; recorder on, a dashboard open."""


class SSEViewer:
    """A dashboard client: reads /dashboard/events in a thread until stopped."""

    def __init__(self, base: str, api_key: str | None = None) -> None:
        self.base, self.api_key = base, api_key
        self.events = self.bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        with httpx.stream("GET", self.base + "/dashboard/events", headers=headers,
                          timeout=None) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.events += 1
                    self.bytes += len(line)
                if self._stop.is_set():
                    return

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class BrowserViewer:
    """A dashboard open in headless Chromium (treadle/bench/headless_browser.py)."""

    def __init__(self, base: str, api_key: str | None = None) -> None:
        self.base, self.api_key = base, api_key
        self.events = self.bytes = 0

    def __enter__(self):
        from treadle.bench.headless_browser import HeadlessChromium

        self._browser = HeadlessChromium()
        if self.api_key:
            self._browser.set_headers({"Authorization": f"Bearer {self.api_key}"})
        self._browser.navigate(self.base + "/dashboard")
        self._browser.wait_for("window.dashboard && dashboard.events >= 1", 60)
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.events = self._browser.evaluate("dashboard.events")
        finally:
            self._browser.close()


def served_cost(serve_options: list[str], num_requests: int = 64, repeats: int = 3,
                viewer: str = "sse", seed: int = 0, max_model_len: int = 2048,
                progress: bool = False, on_first: bool = False) -> dict:
    """Throughput of the engine-core workload served with the recorder off, on, and on
    with a dashboard open; see the module docstring. `on_first` launches the server with
    the recorder before the one without (to tell a launch-order effect from the
    recorder's)."""
    import contextlib

    from treadle.measure import workloads
    from treadle.measure.launch import launched_server
    from treadle.measure.http_load import run_load, served_model, summarize

    viewer_type = {"sse": SSEViewer, "browser": BrowserViewer}[viewer]
    runs: dict[str, list[dict]] = {name: [] for name in SYSTEMS}
    with contextlib.ExitStack() as stack:
        launches = {"off": [*serve_options, "--no-dashboard", "--request-timelines", "0"],
                    "on": serve_options}
        urls = {name: stack.enter_context(launched_server(launches[name]))[0]
                for name in (("on", "off") if on_first else ("off", "on"))}
        off_url, on_url = urls["off"], urls["on"]
        card = served_model(on_url)
        workload = workloads.synthetic(num_requests=num_requests, seed=seed,
                                       max_model_len=max_model_len,
                                       vocab_size=card.get("vocab_size") or 49152,
                                       num_long=min(4, num_requests))
        for repeat in range(repeats):
            order = SYSTEMS[repeat % 3:] + SYSTEMS[:repeat % 3]
            for name in order:
                url = off_url if name == "off" else on_url
                watch = viewer_type(url) if name == "open" else contextlib.nullcontext()
                with watch as v:
                    results, duration = asyncio.run(run_load(
                        url, workload, card["id"], seed=seed, progress=progress))
                summary = summarize(results, duration)
                if summary["num_failed"]:
                    raise RuntimeError(f"{name}: {summary['num_failed']} requests failed: "
                                       f"{summary['errors']}")
                runs[name].append({"repeat": repeat, "order": order.index(name),
                                   "output_tokens_per_s": summary["output_tokens_per_s"],
                                   "total_tokens_per_s": summary["total_tokens_per_s"],
                                   "duration_s": duration,
                                   "viewer_events": getattr(v, "events", None),
                                   "viewer_bytes": getattr(v, "bytes", None)})
                print(f"repeat {repeat} {name:>4}: {summary['output_tokens_per_s']:.1f} "
                      f"output tok/s in {duration:.1f} s", flush=True)
    medians = {name: statistics.median(r["output_tokens_per_s"] for r in rs)
               for name, rs in runs.items()}
    tps = {name: [r["output_tokens_per_s"] for r in rs] for name, rs in runs.items()}
    return {"workload": workload.description | {"name": workload.name},
            "serve_options": serve_options, "viewer": viewer, "repeats": repeats,
            "launched_first": "on" if on_first else "off",
            "runs": runs, "median_output_tokens_per_s": medians,
            "ratio_to_off": {name: medians[name] / medians["off"] for name in SYSTEMS},
            "ratio_open_to_on": medians["open"] / medians["on"],
            "per_repeat_open_to_on": [o / n for o, n in zip(tps["open"], tps["on"])],
            "per_repeat_on_to_off": [n / f for n, f in zip(tps["on"], tps["off"])]}
