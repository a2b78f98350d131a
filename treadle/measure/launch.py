"""Start `treadle serve` as a child process on 127.0.0.1, wait for /health, stop it by PID.

Used by `treadle bench serve --launch` and by the server tests. The child's output goes
to a log file, never to a pipe: an unread pipe fills after a few hundred access-log lines
and then blocks the server mid-request. The child gets SIGTERM (a graceful drain) and is
killed only if it does not exit within the timeout. Unless its options name one, the
child gets a Batch API state directory of its own, removed after it: a launched server
never resumes (and spends the benchmark's time on) the user's batches, and two launched
at once never share one. `end_children_on_termination` makes SIGTERM and SIGHUP unwind
the process as Ctrl-C does, so those stops run when the benchmark itself is stopped.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def peer_environment(environ: dict | None = None) -> dict[str, str]:
    """This process's environment without the OpenMP variables treadle set for an engine
    of its own (config.OMP_ENV_MARKER names them): what a peer system (llama.cpp, vLLM)
    starts with, so that it runs on its own defaults."""
    from treadle.config import OMP_ENV_MARKER

    env = dict(os.environ if environ is None else environ)
    for key in env.pop(OMP_ENV_MARKER, "").split(","):
        if key:
            env.pop(key, None)
    return env


TERMINATING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def end_children_on_termination() -> None:
    """From now on SIGTERM and SIGHUP raise SystemExit(128 + signal) in the main thread, so
    every `finally` that stops a child (a launched server, a peer, an offline runner, the
    background load) runs before this process ends. Python's default for these signals ends
    the process at once, and children that started sessions of their own (peers, shell
    commands) would keep running. A second signal while those stops run is ignored; SIGKILL
    still ends everything at once."""
    def unwind(signum, frame):
        for sig in TERMINATING_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    for sig in TERMINATING_SIGNALS:
        signal.signal(sig, unwind)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, proc: subprocess.Popen, timeout_s: float, log_path: str) -> None:
    """Return once `base`/health answers 200; raise if the process exits or time runs out."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            tail = Path(log_path).read_text(errors="replace")[-4000:]
            raise RuntimeError(f"server exited with {proc.returncode}; its log ends:\n{tail}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"server did not become healthy in {timeout_s} s; "
                               f"its log: {log_path}")
        time.sleep(0.2)


@contextmanager
def launched_server(serve_args: list[str], startup_timeout: float = 300.0,
                    log_level: str = "WARNING") -> Iterator[tuple[str, subprocess.Popen]]:
    """Yields (base URL, process) of `treadle serve <serve_args> --port <free port>`.

    The process's `log_path` attribute names the file holding its output."""
    with tempfile.TemporaryDirectory(prefix="treadle-batch-state-") as state:
        if not any(a == "--state-dir" or a.startswith("--state-dir=") for a in serve_args):
            serve_args = ["--state-dir", state, *serve_args]
        with _launched(serve_args, startup_timeout, log_level) as served:
            yield served


def stop(proc: subprocess.Popen, group: bool = False) -> None:
    """End a server this process started, by its PID (`group`: its whole process group,
    for a shell command's children): SIGTERM, then SIGKILL after 60 s."""
    if proc.poll() is not None:
        return
    kill = os.killpg if group else os.kill
    kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        kill(proc.pid, signal.SIGKILL)
        proc.wait()


@contextmanager
def _launched(serve_args: list[str], startup_timeout: float,
              log_level: str) -> Iterator[tuple[str, subprocess.Popen]]:
    port = free_port()
    cmd = [sys.executable, "-m", "treadle.cli", "--log-level", log_level, "serve",
           "--host", "127.0.0.1", "--port", str(port), *serve_args]
    log = tempfile.NamedTemporaryFile(prefix="treadle-serve-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    proc.log_path = log.name
    log.close()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, startup_timeout, proc.log_path)
        yield base, proc
    finally:
        stop(proc)
