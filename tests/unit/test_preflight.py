"""The fail-fast checks (treadle/cli/preflight.py): the port bound and held, the model
option, the optional packages with the extra that installs them."""

from __future__ import annotations

import socket

import pytest

from treadle.cli import preflight
from treadle.cli.preflight import PreflightError, bind_port, check_model, check_packages


def test_bind_port_holds_the_port_and_a_second_bind_fails():
    sock = bind_port("127.0.0.1", 0)
    port = sock.getsockname()[1]
    try:
        with pytest.raises(PreflightError, match=f"port {port} on 127.0.0.1 is already in use"):
            bind_port("127.0.0.1", port)
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # listening: a client waits in the backlog instead of being refused
    finally:
        sock.close()
    bind_port("127.0.0.1", port).close()  # free again


def test_bind_port_names_a_host_it_cannot_resolve():
    with pytest.raises(PreflightError, match="--host"):
        bind_port("no-such-host.invalid", 0)


def test_model_checks(tmp_path, monkeypatch):
    check_model({"model": None})
    check_model({"model": "demo"})
    with pytest.raises(PreflightError, match="not found.*--model"):
        check_model({"model": str(tmp_path / "missing")})
    (tmp_path / "empty").mkdir()
    with pytest.raises(PreflightError, match="neither config.json nor a .gguf"):
        check_model({"model": str(tmp_path / "empty")})
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text("{}")
    with pytest.raises(PreflightError, match="no \\*.safetensors"):
        check_model({"model": str(tmp_path / "noweights")})
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"PK\x03\x04 not gguf")
    with pytest.raises(PreflightError, match="not a GGUF file"):
        check_model({"model": str(fake)})
    (tmp_path / "w.bin").write_text("x")
    with pytest.raises(PreflightError, match="not a .gguf file"):
        check_model({"model": str(tmp_path / "w.bin")})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(PreflightError, match="HF_HUB_OFFLINE=1"):
        check_model({"model": "someorg/some-model-not-cached",
                     "download_dir": str(tmp_path / "hf")})


@pytest.mark.parametrize("options, extra", [
    ({"replicas": 2}, "ray"), ({"ray_address": "auto"}, "ray"),
    ({"prefill_replicas": 1, "decode_replicas": 1}, "ray"),
    ({"otlp_traces_endpoint": "http://127.0.0.1:4318"}, "otel"),
    ({"attention_backend": "triton"}, "triton")])
def test_missing_packages_name_the_extra(monkeypatch, options, extra):
    monkeypatch.setattr(preflight, "_installed", lambda module: False)
    with pytest.raises(PreflightError, match=rf"pip install 'treadle\[{extra}\]'"):
        check_packages(options)
    monkeypatch.setattr(preflight, "_installed", lambda module: True)
    check_packages(options)


def test_options_that_need_nothing_optional_pass(monkeypatch):
    monkeypatch.setattr(preflight, "_installed", lambda module: False)
    check_packages({"replicas": 1, "attention_backend": "auto", "otlp_traces_endpoint": None})
