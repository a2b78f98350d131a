"""core/ (and the engine core above it) must never import torch: it is the part that is
tested without a model, and that will run beside workers in other processes. Imported
here in a fresh interpreter in which importing torch fails."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import treadle.core

_BLOCK_TORCH = """
import importlib.abc, sys
class _NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is not importable in this test")
sys.meta_path.insert(0, _NoTorch())
import importlib
for name in sys.argv[1:]:
    importlib.import_module(name)
print("imported", len(sys.argv) - 1)
"""


def torch_free_modules() -> list[str]:
    core = [m.name for m in pkgutil.walk_packages(treadle.core.__path__, "treadle.core.")]
    return core + ["treadle.engine.core", "treadle.executor", "treadle.executor.mp"]


def test_core_imports_without_torch():
    modules = torch_free_modules()
    assert "treadle.core.scheduler" in modules and "treadle.core.kv.manager" in modules
    result = subprocess.run([sys.executable, "-c", _BLOCK_TORCH, *modules],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert f"imported {len(modules)}" in result.stdout


def test_the_check_would_catch_torch():
    result = subprocess.run([sys.executable, "-c", _BLOCK_TORCH, "treadle.worker.worker"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "torch is not importable" in result.stderr
