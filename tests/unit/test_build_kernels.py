"""`treadle build-kernels` and the kernel build's announcement (issue 47: a first start
spent 210 s building kernels with no log line before it ended)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from treadle.cli import main
from treadle.worker.cpu import cpu_isa, native, native_quant


def test_build_kernels_builds_every_level_and_the_quantized_variants(monkeypatch, capsys):
    built, variants = [], []

    class Built:
        def __init__(self, isa):
            self.isa = isa

    monkeypatch.setattr(native, "compiler", lambda: "/usr/bin/gcc")
    monkeypatch.setattr(native, "load_kernels", lambda isa: built.append(isa) or Built(isa))
    monkeypatch.setattr(native, "library_path", lambda isa: Path(f"/cache/kernels-{isa}.so"))
    monkeypatch.setattr(native_quant, "build_variant",
                        lambda flags: variants.append(tuple(flags)) or object())
    assert main(["build-kernels"]) == 0
    assert built == (cpu_isa.executable_levels() or ["native"])
    runnable = [v for v in native_quant.ISA_VARIANTS if native_quant.cpu_runs(v)]
    assert sorted(variants) == sorted(tuple(native_quant.ISA_VARIANTS[v][0]) for v in runnable)
    out = capsys.readouterr().out
    assert all(f"kernels-{level}.so" in out for level in built)
    built.clear(), variants.clear()
    assert main(["build-kernels", "--isa", "auto"]) == 0
    assert built == ["auto"] and variants == []


def test_build_kernels_without_a_compiler_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setattr(native, "compiler", lambda: None)
    assert main(["build-kernels"]) == 1
    assert "install gcc" in capsys.readouterr().err


def test_a_kernel_build_is_announced_before_it_starts(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("TREADLE_CACHE_DIR", str(tmp_path))
    seen = []

    def fake_build(compiler, sources, target, isa):
        seen.append([r.getMessage() for r in caplog.records])
        raise OSError("stopped here")  # the test needs no real build

    monkeypatch.setattr(native, "_build", fake_build)
    levels = cpu_isa.executable_levels()
    if not levels or native.compiler() is None:
        pytest.skip("no x86 level or no compiler here")
    with caplog.at_level(logging.INFO, logger="treadle.worker.cpu.native"):
        assert native.load_kernels(levels[-1]) is None
    (before,) = seen
    assert any("building the C kernels for" in m and "about" in m and "build-kernels" in m
               for m in before), before
