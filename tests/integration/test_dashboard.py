"""The dashboard, request timelines and their keys, served by `treadle serve` under load:
two tenants (weights 1 and 3, the fair policy), a KV cache small enough that requests
are swapped out (admission without lookahead), and a --trace file of the same run. A
headless Chromium (Debian's package) loads /dashboard as one tenant, waits for the
charts to move, compares the numbers on the page with /metrics and saves a screenshot."""

from __future__ import annotations

import base64
import json
import os
import shutil
import threading
import time

import httpx
import pytest

from server_fixtures import running_server, TINY_DEMO
from treadle.bench.headless_browser import HeadlessChromium, find_chromium
from treadle.engine.trace import read_trace
from treadle.models.demo import write_demo_model

KEYS = {"alpha": "key-alpha", "beta": "key-beta"}
WEIGHTS = {"alpha": 1, "beta": 3}


def bearer(tenant):
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


def basic(key, user="me"):
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{key}".encode()).decode()}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dash")
    model = str(write_demo_model(folder / "m", seed=5, config_overrides=TINY_DEMO))
    keys = folder / "keys.yaml"
    keys.write_text("".join(f"- {{key: {KEYS[t]}, tenant: {t}, weight: {WEIGHTS[t]}}}\n"
                            for t in KEYS))
    trace = folder / "trace.jsonl"
    with running_server(model, "--num-kv-blocks", "28", "--max-num-seqs", "8",
                        "--preemption-mode", "swap", "--scheduling-policy", "fair",
                        # admit on free blocks alone, so that requests are swapped out
                        "--admission-lookahead-tokens", "0",
                        "--api-keys-file", str(keys), "--trace", str(trace),
                        "--dashboard-interval", "0.5") as (base, _):
        yield base, trace, {t: [] for t in KEYS}


SWAPPING_TOKENS = 56
"""Output tokens of the timeline test's load: 32 + k + 1 prompt tokens and these make 6
blocks of 16, so 8 running requests need more than the 28 blocks even when each tenant's
share their 32-token prefix (at 40 tokens they fit exactly, and a CI run went without a
preemption: the timelines' preemptions then went untested)."""


def complete(base, tenant, k, j, max_tokens=40):
    """Thread k's j-th request: the j-th requests of one tenant share a 32-token prefix."""
    r = httpx.post(base + "/v1/completions", headers=bearer(tenant), timeout=300,
                   json={"prompt": [5 + j] * 32 + [100 + k] * (1 + k), "max_tokens": max_tokens,
                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["id"]


class Load:
    """Background traffic from both tenants: `per_thread` requests per thread, and with
    `hold` more until `release()`, so that a check made mid-load sees the engine stepping
    however fast or slow the host ran the first requests."""

    def __init__(self, base, sent, threads_per_tenant=5, per_thread=4, max_tokens=40,
                 hold=False):
        self.errors: list = []
        self.released = threading.Event()
        if not hold:
            self.released.set()
        self.threads = [threading.Thread(target=self._run,
                                         args=(base, sent, t, k, per_thread, max_tokens))
                        for t in KEYS for k in range(threads_per_tenant)]

    def _run(self, base, sent, tenant, k, per_thread, max_tokens):
        try:
            j = 0
            while j < per_thread or not self.released.is_set():
                sent[tenant].append(complete(base, tenant, k, j % per_thread, max_tokens))
                j += 1
        except Exception as exc:  # noqa: BLE001
            self.errors.append(exc)

    def release(self) -> None:
        self.released.set()

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.release()
        for t in self.threads:
            t.join(timeout=600)
        assert not self.errors, self.errors


def metrics(base) -> dict[str, float]:
    """/metrics as {name{labels}: value}, and request_success summed as 'finished'."""
    out: dict[str, float] = {"finished": 0.0}
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line.startswith("treadle:"):
            key, value = line.rsplit(" ", 1)
            name = key.split("{")[0][len("treadle:"):]
            out[name] = out.get(name, 0.0) + float(value)
            if name == "request_success_total":
                out["finished"] += float(value)
    return out


def events(base, headers, count, timeout=60):
    got = []
    with httpx.stream("GET", base + "/dashboard/events", headers=headers,
                      timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                got.append(json.loads(line[len("data: "):]))
                if len(got) == count:
                    break
    return got


def test_the_dashboard_needs_a_key_and_takes_it_as_a_basic_password(served):
    base, _, _ = served
    r = httpx.get(base + "/dashboard")
    assert r.status_code == 401
    challenges = r.headers.get_list("www-authenticate")
    assert "Bearer" in challenges and any(c.startswith("Basic ") for c in challenges)
    assert httpx.get(base + "/dashboard", headers=basic("wrong")).status_code == 401
    for headers in (bearer("alpha"), basic(KEYS["alpha"])):
        page = httpx.get(base + "/dashboard", headers=headers)
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert "EventSource" in page.text
        assert "http://" not in page.text and "https://" not in page.text  # works offline
    assert len(events(base, basic(KEYS["beta"]), 1)) == 1
    # Basic is for the dashboard's GETs only: never for the API.
    assert httpx.get(base + "/v1/requests/x", headers=basic(KEYS["alpha"])).status_code == 401
    assert httpx.get(base + "/v1/models", headers=basic(KEYS["alpha"])).status_code == 401
    assert httpx.get(base + "/v1/requests/x").status_code == 401
    assert httpx.get(base + "/dashboard/events").status_code == 401


def test_served_timelines_match_the_trace_and_each_tenant_sees_its_own(served):
    base, trace_path, sent = served
    seen_rows: dict[str, set] = {"alpha": set()}
    tenants_seen = []

    def watch():
        for ev in events(base, bearer("alpha"), 12, timeout=120):
            for step in ev["steps"]:
                seen_rows["alpha"].update(cell[0] for cell in step[12])
            tenants_seen.append([t["tenant"] for t in ev["tenants"]])

    watcher = threading.Thread(target=watch)
    watcher.start()
    with Load(base, sent, max_tokens=SWAPPING_TOKENS):
        pass
    watcher.join(timeout=120)
    trace = read_trace(trace_path)
    swaps = 0
    for tenant, ids in sent.items():
        other = next(t for t in KEYS if t != tenant)
        for rid in ids:
            r = httpx.get(f"{base}/v1/requests/{rid}", headers=bearer(tenant))
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["id"] == rid and body["object"] == "request.timeline"
            (t,) = body["requests"]
            assert t["tenant"] == tenant and t["status"] == "finished"
            assert t["num_output_tokens"] == SWAPPING_TOKENS and t["finish_reason"] == "length"
            from_trace = [(s.step, n, kind) for s in trace.steps
                          for r2, n, kind in s.scheduled if r2 == rid]
            from_timeline = []
            for c in t["chunks"]:
                from_timeline += ([(c["first_step"], c["num_tokens"], "prefill")]
                                  if c["kind"] == "prefill" else
                                  [(s, 1, "decode") for s in range(c["first_step"],
                                                                   c["last_step"] + 1)])
            assert from_timeline == from_trace, rid
            assert [p["step"] for p in t["preemptions"]] == [
                s.step for s in trace.steps if rid in s.preempted]
            swaps += sum(p["kind"] == "swap" for p in t["preemptions"])
            hidden = httpx.get(f"{base}/v1/requests/{rid}", headers=bearer(other))
            unknown = httpx.get(f"{base}/v1/requests/cmpl-unknown", headers=bearer(other))
            assert hidden.status_code == unknown.status_code == 404
            assert hidden.json()["error"]["type"] == "not_found_error"
    m = metrics(base)
    assert swaps == m["num_preemptions_swap_total"] > 0  # every request of the run is here
    assert seen_rows["alpha"] and seen_rows["alpha"] <= set(sent["alpha"])
    assert not seen_rows["alpha"] & set(sent["beta"])
    assert any(names == ["alpha", "others"] for names in tenants_seen), tenants_seen
    assert all(set(names) <= {"alpha", "others"} for names in tenants_seen)


def test_the_schema_documents_request_timelines(served):
    base, _, _ = served
    spec = httpx.get(base + "/openapi.json", headers=bearer("alpha")).json()
    for path in ("/v1/requests/{request_id}", "/dashboard/requests/{request_id}"):
        op = spec["paths"][path]["get"]
        assert {"200", "401", "404", "503"} <= set(op["responses"]) and "422" not in op["responses"]
        assert op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"] \
            .endswith("/RequestTimelines")
    # Basic (the key as a password) is declared on the dashboard's routes only.
    assert spec["paths"]["/v1/requests/{request_id}"]["get"]["security"] == [
        {"bearer": []}, {"apiKey": []}]
    assert spec["components"]["securitySchemes"]["basic"]["scheme"] == "basic"
    for path, content in (("/dashboard", "text/html"),
                          ("/dashboard/events", "text/event-stream"),
                          ("/dashboard/requests/{request_id}", "application/json")):
        op = spec["paths"][path]["get"]
        assert op["security"] == [{"bearer": []}, {"apiKey": []}, {"basic": []}]
        assert list(op["responses"]["200"]["content"]) == [content]
        assert "401" in op["responses"]


def assert_every_row_drawn(browser) -> None:
    """Every row of the timeline's layout has a coloured pixel: a request of the steps
    drawn is never left without its row, and the canvas is no taller than its rows."""
    bands = browser.evaluate("""(() => {
        const c = document.getElementById('c-timeline'), g = c.getContext('2d');
        const dpr = c._dpr, rowH = c._rowH, n = dashboard.rows.size;
        const img = g.getImageData(0, 0, c.width, c.height).data, empty = [];
        for (let row = 0; row < n; row++) {
            let hit = false;
            for (let y = Math.floor(row * rowH * dpr); y < Math.floor((row + 1) * rowH * dpr) && !hit; y++)
                for (let x = 0; x < c.width && !hit; x++) hit = img[4 * (y * c.width + x) + 3] > 0;
            if (!hit) empty.push(row);
        }
        return {rows: n, empty, height: c._h, rowH, note: document.getElementById('rows-note').textContent};
    })()""")
    assert bands["rows"] and not bands["empty"], bands
    assert bands["height"] <= max(70, bands["rows"] * bands["rowH"]), bands
    assert "not drawn" not in bands["note"]


_HOVER_NEWEST = """(() => {
    const c = document.getElementById('c-timeline');
    const steps = c._shown;
    let k = 0;
    while (k < steps.length - 1 && steps[steps.length - 1 - k].cells.length === 0) k++;
    const rid = steps[steps.length - 1 - k].cells[0][0];
    c.scrollIntoView();
    const box = c.getBoundingClientRect();
    c.dispatchEvent(new MouseEvent('mousemove', {clientX: box.right - 2 - 4 * k,
        clientY: box.top + dashboard.rows.get(rid) * c._rowH + c._rowH / 2}));
    function tipBox() {
        const t = document.getElementById('tip'), b = t.getBoundingClientRect();
        return {display: t.style.display, left: b.left, right: b.right, top: b.top,
                bottom: b.bottom, vw: document.documentElement.clientWidth,
                vh: document.documentElement.clientHeight, text: t.textContent};
    }
    return tipBox();
})()"""
_CLICK_NEWEST_DECODE = """(() => {
    // Of the newest step's decoding requests, the one seen in the most steps: a long
    // request (380 tokens, past the 44 steps waited for), still running when the panel
    // first asks for it, whatever short requests finish meanwhile.
    const c = document.getElementById('c-timeline'), steps = c._shown;
    const seen = new Map();
    for (const s of steps) for (const x of s.cells) seen.set(x[0], (seen.get(x[0]) || 0) + 1);
    for (let k = 0; k < steps.length; k++) {
        const decoding = steps[steps.length - 1 - k].cells.filter(x => x[1] > 0 && x[2] === 1);
        if (!decoding.length) continue;
        const cell = decoding.reduce((a, b) => seen.get(a[0]) >= seen.get(b[0]) ? a : b);
        c.scrollIntoView();
        const box = c.getBoundingClientRect();
        c.dispatchEvent(new MouseEvent('click', {clientX: box.right - 2 - 4 * k,
            clientY: box.top + dashboard.rows.get(cell[0]) * c._rowH + c._rowH / 2}));
        return cell[0];
    }
})()"""
_LONG_REQUEST_DECODING = """(() => {
    // A request decoding in the newest step that has decoded in 44 steps or more: only the
    // 380-token request can have (the others stop at 40 tokens).
    const st = dashboard.steps, seen = new Map();
    if (!st.length) return false;
    for (const s of st) for (const x of s.cells)
        if (x[1] > 0 && x[2] === 1) seen.set(x[0], (seen.get(x[0]) || 0) + 1);
    return st[st.length - 1].cells.some(x => x[1] > 0 && x[2] === 1
        && dashboard.rows.has(x[0]) && seen.get(x[0]) >= 44);
})()"""
_CROWDED_STEPS = """(() => {
    dashboard.steps = []; dashboard.carry.clear();
    document.getElementById('c-timeline').style.width = '';
    for (let i = 0; i < 100; i++) {
        const cells = [];
        for (let r = 2 * i; r < Math.min(200, 2 * i + 10); r++) cells.push(['crowd-' + r, 1, r % 2]);
        addStep([1e9 + i, 1e9 + i, 0, 0, 0, 0, cells.length, 1, 0, 0, 0, 0, cells, []]);
    }
    drawTimeline();
    const wrap = document.getElementById('timeline-wrap');
    return {rows: dashboard.rows.size, scrolls: wrap.scrollHeight > wrap.clientHeight + 1,
            note: document.getElementById('rows-note').textContent};
})()"""


_TILES = {"m-running": "num_requests_running", "m-waiting": "num_requests_waiting",
          "m-swapped": "num_requests_swapped", "m-kv": "kv_cache_usage_perc",
          "m-finished": "finished", "m-gen": "generation_tokens_total",
          "m-preempt": "num_preemptions_total"}


def test_the_page_in_a_browser_under_load_matches_the_metrics(served, tmp_path):
    chromium = find_chromium()
    if chromium is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium; .ci/run does)")
    base, _, sent = served
    keep = os.environ.get("TREADLE_DASHBOARD_SCREENSHOT")  # docs/dashboard.png: more history
    read_tiles = ("Object.fromEntries([...document.querySelectorAll('.tile .v')]"
                  ".map(e => [e.id, e.dataset.value === '' ? null : Number(e.dataset.value)]))")
    with HeadlessChromium(chromium, width=1400, height=1100) as browser:
        browser.set_headers(bearer("alpha"))  # EventSource and fetch send it too
        browser.navigate(base + "/dashboard")
        with Load(base, sent, threads_per_tenant=5, per_thread=30 if keep else 3,
                  hold=True) as load:
            browser.wait_for("window.dashboard && dashboard.events >= 2", 60)
            browser.wait_for("dashboard.steps.length >= 20 && dashboard.rows.size >= 3", 120)
            first = browser.evaluate("[document.getElementById('c-tokens').toDataURL(),"
                                     " document.getElementById('c-timeline').toDataURL(),"
                                     " dashboard.events, dashboard.stepsSeen]")
            # The load is held until the page has drawn newer steps: on a slow host the
            # first 30 requests could end before this (CI: both charts then unchanged).
            browser.wait_for(f"dashboard.events >= {first[2] + 2}"
                             f" && dashboard.stepsSeen > {first[3]}", 60)
            second = browser.evaluate("[document.getElementById('c-tokens').toDataURL(),"
                                      " document.getElementById('c-timeline').toDataURL()]")
            load.release()
            assert first[0] != second[0] and first[1] != second[1]  # the charts moved
            before = browser.evaluate(read_tiles)
            after = metrics(base)  # counters only grow: the page (older) shows no more
            for tile in ("m-finished", "m-gen", "m-preempt"):
                assert before[tile] <= after[_TILES[tile]]
            rows = browser.evaluate("dashboard.steps.flatMap(s => s.cells.map(c => c[0]))")
            if keep:
                browser.wait_for("dashboard.events >= 150", 300)
            shot = browser.screenshot(tmp_path / "dashboard.png")
            # Every request of the steps drawn has a row with a cell drawn in it.
            assert_every_row_drawn(browser)
            # The tooltip of the newest column (the right edge) stays inside the window.
            tip = browser.evaluate(_HOVER_NEWEST)
            assert tip["display"] == "block" and 0 <= tip["left"] and tip["right"] <= tip["vw"], tip
            # A click on a row shows that request's timeline (GET /dashboard/requests/...),
            # updated until the request ends: a long request, clicked while it runs.
            # (380 tokens, as many as 28 blocks hold beside its prompt: on a quiet machine
            # the tiny model decodes a step in ~2.5 ms, and the page sees steps every 0.5 s)
            long_request = threading.Thread(target=complete, args=(base, "alpha", 9, 0, 380))
            long_request.start()
            browser.wait_for(_LONG_REQUEST_DECODING, 120)
            browser.evaluate(_CLICK_NEWEST_DECODE)
            detail = browser.wait_for("(t => t.includes('prefill chunks') && t)"
                                      "(document.getElementById('detail').textContent)", 30)
            long_request.join(timeout=600)
            ended = browser.wait_for("(t => t.includes('(finished') && t)"
                                     "(document.getElementById('detail').textContent)", 60)
            fetches = browser.evaluate("dashboard.detail.fetches")
            browser.screenshot(tmp_path / "dashboard-detail.png")
        assert set(rows) <= set(sent["alpha"]) and rows  # its own rows only
        assert "tenant alpha" in detail
        # it was running when clicked, and the panel followed it to its end
        assert "(finished" not in detail and "(updating until it ends)" in detail, detail
        assert fetches >= 2 and "(updating" not in ended
        deadline = time.monotonic() + 120
        while True:  # idle: the page must now show exactly what /metrics shows
            m = metrics(base)
            if m["num_requests_running"] == m["num_requests_waiting"] == 0:
                break
            assert time.monotonic() < deadline
            time.sleep(0.2)
        n = browser.evaluate("dashboard.events")
        browser.wait_for(f"dashboard.events >= {n + 2}", 30)
        tiles = browser.evaluate(read_tiles)
        m = metrics(base)
        for tile, name in _TILES.items():
            assert tiles[tile] == pytest.approx(m[name]), (tile, tiles[tile], m[name])
        hits, queries = m["prefix_cache_hits_total"], m["prefix_cache_queries_total"]
        assert hits > 0 and tiles["m-hit"] == pytest.approx(hits / queries)
        assert tiles["m-ttft"] is not None and tiles["m-ttft"] > 0
        tenants = browser.evaluate("[...document.querySelectorAll('#tenants tbody tr')]"
                                   ".map(r => r.firstChild.textContent)")
        assert tenants[0] in ("alpha", "others") and set(tenants) <= {"alpha", "others"}
        # The tiles keep each value on one line, the longest latency text included.
        wrapped = browser.evaluate("""(() => {
            setTile('m-ttft', 1, '999 ms / 99.99 s'); setTile('m-preempt', 1, '12,345 (6,789)');
            return [...document.querySelectorAll('.tile .v')].filter(e =>
                e.getBoundingClientRect().height > 1.6 * parseFloat(getComputedStyle(e).fontSize)
                || e.scrollWidth > e.clientWidth + 1).map(e => e.id);
        })()""")
        assert wrapped == []
        # A narrow timeline (15 columns): its rows are exactly the requests it shows.
        held = browser.evaluate("""(() => {
            document.getElementById('c-timeline').style.width = '60px';
            window.dispatchEvent(new Event('resize'));
            const shown = document.getElementById('c-timeline')._shown;
            const drawn = new Set(shown.flatMap(s => s.cells.map(c => c[0])));
            return [shown.length, dashboard.rows.size, drawn.size,
                    [...dashboard.rows.keys()].every(r => drawn.has(r))];
        })()""")
        assert held[0] == 15 and held[1] == held[2] and held[3], held
        # Many requests at once (the issue: 124 of them hidden under an empty canvas):
        # 200 requests over the steps shown, every one with a row, the timeline scrolling.
        crowded = browser.evaluate(_CROWDED_STEPS)
        assert crowded["rows"] == 200 and crowded["scrolls"] and "scroll" in crowded["note"]
        assert_every_row_drawn(browser)
        browser.screenshot(tmp_path / "dashboard-crowded.png")
        assert not browser.console_errors()
    assert shot.stat().st_size > 20_000 and shot.read_bytes()[:4] == b"\x89PNG"
    if keep:  # how docs/dashboard.png is made
        shutil.copy(shot, keep)
