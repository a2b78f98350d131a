"""Headless Chromium driven over the DevTools protocol through a pipe.

Owns starting Debian's `chromium` headless (no sandbox, GPU, QUIC, first-run, background
networking, component updates or sync; a private profile folder), the protocol over
`--remote-debugging-pipe` (file descriptors 3 and 4, NUL-terminated JSON: no websocket
and no package beyond the standard library), and the few calls the dashboard test and
benchmark make: extra request headers (the API key), the viewport, navigate, evaluate,
screenshot. Stopped by its own PID. Why not playwright-core or selenium: both add a
package and a driver pinned to a browser version; the pipe needs only the browser.
It must not: reach beyond the URLs it is given.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--mute-audio",
                  "--remote-debugging-pipe")


def find_chromium() -> str | None:
    """The chromium binary (Debian's package puts it in /usr/bin), or None."""
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    return None


class BrowserError(RuntimeError):
    pass


class HeadlessChromium:
    """One headless browser with one page attached (use as a context manager)."""

    def __init__(self, binary: str | None = None, width: int = 1400, height: int = 1000,
                 timeout_s: float = 60.0) -> None:
        self.binary = binary or find_chromium()
        if self.binary is None:
            raise BrowserError("chromium is not installed (apt-get install -y chromium)")
        self.width, self.height, self.timeout_s = width, height, timeout_s
        self._profile = tempfile.mkdtemp(prefix="treadle-chromium-")
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()
        # Above 10 first, so that moving them to 3 and 4 in the child clobbers neither.
        hi_r = fcntl.fcntl(to_child_r, fcntl.F_DUPFD_CLOEXEC, 10)
        hi_w = fcntl.fcntl(from_child_w, fcntl.F_DUPFD_CLOEXEC, 10)
        os.close(to_child_r)
        os.close(from_child_w)

        def child_fds() -> None:  # the protocol's fds: 3 reads commands, 4 writes answers
            os.dup2(hi_r, 3)  # dup2 leaves the copy inheritable; the originals close on exec
            os.dup2(hi_w, 4)

        try:
            self.proc = subprocess.Popen(
                [self.binary, *CHROMIUM_FLAGS, f"--user-data-dir={self._profile}",
                 f"--window-size={width},{height}", "about:blank"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, close_fds=False, preexec_fn=child_fds)
        finally:
            os.close(hi_r)
            os.close(hi_w)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict] = []
        self.session: str | None = None
        try:
            self._attach()
        except BaseException:
            self.close()
            raise

    # ----- the protocol ------------------------------------------------------------------

    def _send(self, method: str, params: dict | None = None, session: str | None = None) -> int:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._to_child, json.dumps(message).encode() + b"\0")
        return self._next_id

    def _read_message(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BrowserError("chromium did not answer in time")
            ready, _, _ = select.select([self._from_child], [], [], min(left, 0.5))
            if ready:
                chunk = os.read(self._from_child, 1 << 20)
                if not chunk:
                    raise BrowserError(f"chromium exited ({self.proc.poll()})")
                self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(raw)

    def call(self, method: str, params: dict | None = None, session: str | None = "page",
             timeout_s: float | None = None) -> dict:
        """One protocol command on the page's session (session=None: the browser)."""
        sid = self.session if session == "page" else session
        request_id = self._send(method, params, sid)
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while True:
            message = self._read_message(deadline)
            if message.get("id") == request_id:
                if "error" in message:
                    raise BrowserError(f"{method}: {message['error']}")
                return message.get("result", {})
            if "method" in message:
                self.events.append(message)
                del self.events[:-1000]

    def _attach(self) -> None:
        # The first answer waits for chromium's start, not for a page: 3x the call timeout.
        # (A CI run on a host 25% slower than usual, two test workers busy, once went past
        # 60 s here; the same test alone took 16 s.)
        targets = self.call("Target.getTargets", session=None,
                            timeout_s=3 * self.timeout_s)["targetInfos"]
        page = next((t for t in targets if t["type"] == "page"), None)
        target_id = (page["targetId"] if page is not None else
                     self.call("Target.createTarget", {"url": "about:blank"},
                               session=None)["targetId"])
        self.session = self.call("Target.attachToTarget",
                                 {"targetId": target_id, "flatten": True},
                                 session=None)["sessionId"]
        self.call("Page.enable")
        self.call("Runtime.enable")
        self.call("Network.enable")
        self.call("Emulation.setDeviceMetricsOverride", {
            "width": self.width, "height": self.height, "deviceScaleFactor": 1,
            "mobile": False})

    # ----- what the callers use ---------------------------------------------------------

    def set_headers(self, headers: dict[str, str]) -> None:
        """Send these headers with every request of the page (EventSource included)."""
        self.call("Network.setExtraHTTPHeaders", {"headers": headers})

    def navigate(self, url: str) -> None:
        result = self.call("Page.navigate", {"url": url})
        if result.get("errorText"):
            raise BrowserError(f"navigate {url}: {result['errorText']}")

    def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page (JSON-serializable)."""
        result = self.call("Runtime.evaluate", {"expression": expression,
                                                "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 60.0, poll_s: float = 0.25):
        """Evaluate until the expression is truthy; its value."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise BrowserError(f"timed out waiting for {expression}")
            time.sleep(poll_s)

    def console_errors(self) -> list[str]:
        """Exceptions thrown in the page and console.error calls seen so far."""
        out = []
        for e in self.events:
            if e.get("method") == "Runtime.exceptionThrown":
                out.append(json.dumps(e["params"]["exceptionDetails"])[:500])
            elif (e.get("method") == "Runtime.consoleAPICalled"
                  and e["params"].get("type") == "error"):
                out.append(json.dumps(e["params"].get("args"))[:500])
        return out

    def screenshot(self, path: str | Path, full_page: bool = True) -> Path:
        params: dict = {"format": "png"}
        if full_page:
            metrics = self.call("Page.getLayoutMetrics")
            size = metrics.get("cssContentSize") or metrics["contentSize"]
            params["clip"] = {"x": 0, "y": 0, "width": size["width"],
                              "height": size["height"], "scale": 1}
            params["captureBeyondViewport"] = True
        data = self.call("Page.captureScreenshot", params)["data"]
        path = Path(path)
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                try:
                    self._send("Browser.close")
                    self.proc.wait(timeout=10)
                except (OSError, subprocess.TimeoutExpired):
                    self.proc.kill()
                    self.proc.wait()
        finally:
            for fd in (self._to_child, self._from_child):
                try:
                    os.close(fd)
                except OSError:
                    pass
            shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> "HeadlessChromium":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
