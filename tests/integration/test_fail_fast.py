"""`treadle serve`, `generate` and `chat` fail fast (issue 47): a port in use, a model
that does not exist, an option whose package is not installed are each one line naming
the problem and the fix, exit status 2, within seconds, before torch or the model load.
The bound is generous for a busy 2-core machine; what took minutes before (the port was
reported after the whole model load) takes a Python start now."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

BOUND_S = 30.0
"""Generous: a Python start and the CLI's imports (no torch) on a loaded machine."""

_NO_RAY = ("import sys; sys.modules['ray'] = None; from treadle.cli import main; "
           "raise SystemExit(main(sys.argv[1:]))")


def _run(args: list[str], code: str | None = None) -> tuple[subprocess.CompletedProcess, float]:
    cmd = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "treadle.cli",
                                                             *args]
    start = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    return out, time.monotonic() - start


def _one_error_line(out: subprocess.CompletedProcess) -> str:
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr  # no traceback
    return lines[0]


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_a_port_in_use_is_reported_at_once(busy_port):
    out, took = _run(["serve", "--model", "demo", "--port", str(busy_port)])
    assert out.returncode == 2 and took < BOUND_S, (out.returncode, took)
    line = _one_error_line(out)
    assert f"port {busy_port} on 127.0.0.1 is already in use" in line and "--port" in line


@pytest.mark.parametrize("command", [["serve"], ["generate", "--prompt", "x"], ["chat"]])
def test_a_missing_model_is_reported_at_once(tmp_path, command):
    out, took = _run([*command, "--model", str(tmp_path / "nowhere")])
    assert out.returncode == 2 and took < BOUND_S, (out.returncode, took, out.stderr)
    assert "not found" in _one_error_line(out) and "--model" in out.stderr


def test_replicas_without_ray_name_the_extra(tmp_path):
    out, took = _run(["serve", "--model", "demo", "--replicas", "2", "--port", "0"], _NO_RAY)
    assert out.returncode == 2 and took < BOUND_S, (out.returncode, took, out.stderr)
    line = _one_error_line(out)
    assert "--replicas" in line and "pip install 'treadle[ray]'" in line


def test_a_bad_config_file_is_reported_at_once(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("max-num-seqs: 4\nmax-num-sequences: 8\n")
    out, took = _run(["serve", "--config", str(path)])
    assert out.returncode == 2 and took < BOUND_S
    assert "unknown option max-num-sequences" in _one_error_line(out)
