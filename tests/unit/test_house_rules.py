"""The house rules of docs/structure.md, checked on the source: small files and functions,
and imports that run down the layers only.

Read with `ast`, nothing is imported. The layers, top to bottom: the tools and front ends
(cli, bench, sim, measure), the stacks treadle runs inside (integrations: Ray Serve runs
treadle's server as its ingress), server, distributed, engine, executor, worker, models,
layers; core is the scheduler's pure-Python room, beside the worker, below the engine;
kv_events is a wire format the engine speaks (vLLM's KV events), beside core; config and
compat (the options and their refused combinations) sit on kv_specs (what a KV cache is
declared to be), the ground. What a package may not import is listed per package below; a
lazy import inside a function counts like one at the top.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "treadle"
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80
TRITON_KERNELS = PACKAGE / "worker" / "cuda" / "triton"
"""Triton kernels are one function each by construction (the issue's exception)."""

FRONT = ("cli",)
TOOLS = ("bench", "sim", "measure")
ABOVE_ENGINE = ("server", "distributed", "integrations", *FRONT, *TOOLS)
ENGINE_AND_BELOW = ("layers", "models", "worker", "core", "engine", "executor", "kv_events")
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "layers": ("models", "worker", "core", "engine", "executor", *ABOVE_ENGINE),
    "models": ("worker", "core", "engine", "executor", *ABOVE_ENGINE),
    "worker": ("engine", "executor", *ABOVE_ENGINE),
    "core": ("layers", "models", "worker", "engine", "executor", *ABOVE_ENGINE),
    "executor": ("engine", *ABOVE_ENGINE),
    "engine": ABOVE_ENGINE,
    "server": ("integrations", *FRONT, *TOOLS),
    "distributed": (*FRONT, *TOOLS),
    "integrations": (*FRONT, *TOOLS),
    "kv_events": ("layers", "models", "worker", "engine", "executor", *ABOVE_ENGINE),
    "config": ("request", "sampling_params", *ENGINE_AND_BELOW, *ABOVE_ENGINE),
    "compat": ("config", "request", "sampling_params", *ENGINE_AND_BELOW, *ABOVE_ENGINE),
    "kv_specs": ("config", "compat", "request", "sampling_params", *ENGINE_AND_BELOW,
                 *ABOVE_ENGINE),
    "structured": ("worker", "engine", "executor", *ABOVE_ENGINE),
}
"""Package of treadle -> the packages of treadle it must not import."""


def python_files():
    return sorted(PACKAGE.rglob("*.py"))


def _room(parts) -> str:
    """The package (or top-level module) a module path belongs to."""
    return parts[0].removesuffix(".py")


def package_of(path: Path) -> str:
    return _room(path.relative_to(PACKAGE).parts)


def imported_packages(tree: ast.AST) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "treadle" and len(parts) > 1:
                found.add(_room(parts[1:]))
    return found


def test_no_python_file_over_600_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in python_files()
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not long, f"files over {MAX_FILE_LINES} lines: {long}"


def test_no_function_over_80_lines():
    long = {}
    for path in python_files():
        if TRITON_KERNELS in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}"] = n
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_run_down_the_layers(package):
    wrong = {}
    for path in python_files():
        if package_of(path) != package:
            continue
        bad = imported_packages(ast.parse(path.read_text())) & set(FORBIDDEN[package])
        if bad:
            wrong[str(path.relative_to(PACKAGE))] = sorted(bad)
    assert not wrong, f"{package}/ imports upward: {wrong}"


def test_nothing_imports_the_command_line():
    wrong = [str(p.relative_to(PACKAGE)) for p in python_files()
             if package_of(p) != "cli" and "cli" in imported_packages(ast.parse(p.read_text()))]
    assert not wrong, f"modules importing treadle.cli: {wrong}"
