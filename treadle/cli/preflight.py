"""The command line's fail-fast checks: what can be known wrong within seconds is said
before anything heavy (torch, the model, the kernels) starts.

Owns binding the server's port first (`bind_port`: the socket is held and handed to
uvicorn, so that a port in use is reported at once, and no other process takes it while
the model loads), the model option (`treadle.models.resolve.check_model`: a missing path,
a file that is not GGUF, a folder without weights, a Hub id not cached under
HF_HUB_OFFLINE=1) and the optional packages an option needs, with the extra that installs
them (`OPTIONAL_PACKAGES`). Each failure is a `PreflightError`: one line naming the
problem and the fix, which the `treadle` command prints as `error: ...` with exit status
2. It imports neither torch nor the server's packages; feature combinations that are
refused whatever is installed are treadle/compat.py's.
"""

from __future__ import annotations

import importlib.util
import socket
from dataclasses import dataclass
from typing import Any, Callable


BACKLOG = 2048
"""Pending connections the held socket queues (uvicorn's default backlog)."""


class PreflightError(ValueError):
    """A start-up check failed: the message names the problem and the fix."""


@dataclass(frozen=True)
class OptionalPackage:
    """A module an option needs, and the extra of treadle's that installs it."""

    option: str
    """The option, as the user wrote it (for the message)."""
    modules: tuple[str, ...]
    extra: str
    wanted: Callable[[dict[str, Any]], bool]
    """Whether the given options (flat, by dataclass field name) need the modules."""


OPTIONAL_PACKAGES = (
    OptionalPackage("--replicas / --ray-address / --prefill-replicas", ("ray",), "ray",
                    lambda o: (o.get("replicas") or 1) > 1 or o.get("ray_address") is not None
                    or bool(o.get("prefill_replicas")) or bool(o.get("decode_replicas"))),
    OptionalPackage("--otlp-traces-endpoint",
                    ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http"), "otel",
                    lambda o: o.get("otlp_traces_endpoint") is not None),
    OptionalPackage("--attention-backend triton", ("triton",), "triton",
                    lambda o: o.get("attention_backend") == "triton"),
)
"""Options whose code lives in an optional extra (pyproject.toml), checked at start."""


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a broken install
        return False


def check_packages(options: dict[str, Any]) -> None:
    """PreflightError for the first option given whose package is not installed."""
    for need in OPTIONAL_PACKAGES:
        if need.wanted(options):
            missing = [m for m in need.modules if not _installed(m)]
            if missing:
                raise PreflightError(
                    f"{need.option} needs {missing[0].split('.')[0]}, which is not installed: "
                    f"pip install 'treadle[{need.extra}]'")


def check_model(options: dict[str, Any]) -> None:
    """PreflightError when the model option cannot name a checkpoint (see the module)."""
    from treadle.models.resolve import check_model as check

    try:
        check(options.get("model"), options.get("revision"), options.get("download_dir"))
    except (FileNotFoundError, ValueError) as exc:
        raise PreflightError(f"{exc} (--model)") from None


def bind_port(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port) and listening, handed to uvicorn once the engine is
    ready; PreflightError when the address is in use or cannot be bound. It listens at
    once: a socket only bound holds nothing against another one bound with SO_REUSEADDR
    (two servers started together would both pass). Connections made while the model
    loads wait in the backlog and are answered once the server runs."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise PreflightError(f"--host {host}: cannot resolve it ({exc.strerror}); pass an "
                             "address such as 127.0.0.1 or 0.0.0.0") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        if exc.errno in (98, 48):  # EADDRINUSE on Linux, macOS
            raise PreflightError(f"port {port} on {host} is already in use: stop what holds "
                                 "it, or pass another --port") from None
        raise PreflightError(f"cannot bind {host}:{port} ({exc.strerror or exc}): pass "
                             "another --host or --port") from None
    sock.set_inheritable(False)
    return sock


def check_engine_options(options: dict[str, Any]) -> None:
    """What every command that starts an engine checks first: its packages, its model."""
    check_packages(options)
    check_model(options)
