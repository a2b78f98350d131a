"""The tools beside the engine reach it through its public API only.

Every module of treadle/bench (the benchmarks users run), treadle/sim (the capacity
simulator) and treadle/measure (the kit those two share) is parsed with `ast` (imports
inside functions included) and may import, besides the standard library and third-party
packages:

- its own package, private names included;
- treadle/measure, from bench/ and sim/ (measure/ imports neither of them, and bench/
  and sim/ never import each other);
- the engine's public API, public names only (no `_name`, no `_module`):
  `treadle` (LLM, SamplingParams, LoRARequest, EngineConfig), `treadle.config`,
  `treadle.sampling_params`, `treadle.request`, `treadle.metrics`, `treadle.paths`,
  `treadle.engine.*` (EngineCore, AsyncEngine, the trace reader, the step recorder),
  `treadle.router.*` (the routers the server uses), and from treadle.core only what the
  simulator drives the real scheduler with: `treadle.core.scheduler` (Scheduler),
  `treadle.core.outputs` (the step messages it produces and consumes) and
  `treadle.core.policy` (PreemptionCosts, its constructor's argument);
- of treadle.models, only how a model is named and found, never how it is built or run:
  `treadle.models.resolve`, `treadle.models.demo`, `treadle.models.default_model` and
  `treadle.models.gguf_reader` (a GGUF file's metadata).

Everything else is refused: treadle.worker, treadle.layers, treadle.executor,
treadle.server, treadle.distributed, treadle.structured, treadle.integrations, the other
modules of treadle.core and treadle.models, and any attribute chain `.executor.worker`
(the executor's collective_rpc is the one way to the workers). Micro-benchmarks that need
more live in benchmarks/, outside the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ("treadle.bench", "treadle.sim", "treadle.measure")

PUBLIC_MODULES = ("treadle", "treadle.config", "treadle.sampling_params", "treadle.request",
                  "treadle.metrics", "treadle.paths", "treadle.core.scheduler",
                  "treadle.core.outputs", "treadle.core.policy", "treadle.models.resolve",
                  "treadle.models.demo", "treadle.models.default_model",
                  "treadle.models.gguf_reader")
"""Modules of the engine a tool may import (public names only)."""

PUBLIC_PACKAGES = ("treadle.engine", "treadle.router")
"""Packages of the engine whose public modules a tool may import (public names only)."""

MAY_IMPORT = {"treadle.bench": ("treadle.measure",), "treadle.sim": ("treadle.measure",),
              "treadle.measure": ()}
"""The other tool packages each tool package may import."""


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _private(name: str) -> bool:
    return any(part.startswith("_") and part != "__future__" for part in name.split("."))


def import_problems(source: str, package: str, where: str = "") -> list[str]:
    """What a module of `package` (one of TOOLS) imports or reaches that it must not."""
    problems = []

    def check(module: str, names: list[str], line: int) -> None:
        if not _within(module, "treadle") or _within(module, package):
            return
        if any(_within(module, tool) for tool in TOOLS):
            if not any(_within(module, ok) for ok in MAY_IMPORT[package]):
                problems.append(f"{where}:{line}: {package} imports {module}")
            elif _private(module) or any(_private(n) for n in names):
                problems.append(f"{where}:{line}: private name from {module}: {names}")
            return
        public = module in PUBLIC_MODULES or any(
            _within(module, p) for p in PUBLIC_PACKAGES)
        if not public or _private(module):
            problems.append(f"{where}:{line}: {module} is not the engine's public API")
        elif any(_private(n) for n in names):
            problems.append(f"{where}:{line}: private name from {module}: {names}")

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:  # `from package import module` checks the module
                sub = f"{node.module}.{alias.name}"
                check(sub if _is_module(sub) else node.module, [alias.name], node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.level:
            problems.append(f"{where}:{node.lineno}: relative import (name the module)")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                check(alias.name, [], node.lineno)
        elif (isinstance(node, ast.Attribute) and node.attr == "worker"
              and isinstance(node.value, ast.Attribute) and node.value.attr == "executor"):
            problems.append(f"{where}:{node.lineno}: reaches .executor.worker "
                            "(use executor.collective_rpc)")
    return problems


def _is_module(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _tool_modules():
    for package in TOOLS:
        folder = ROOT.joinpath(*package.split("."))
        for path in sorted(folder.rglob("*.py")):
            yield package, path


def test_tools_import_the_public_api_only():
    problems = []
    for package, path in _tool_modules():
        problems += import_problems(path.read_text(), package, str(path.relative_to(ROOT)))
    assert not problems, "\n".join(problems)


def test_every_tool_package_is_parsed():
    found = {package for package, _ in _tool_modules()}
    assert found == set(TOOLS)
    assert sum(1 for _ in _tool_modules()) > 30


@pytest.mark.parametrize("source, package, why", [
    ("from treadle.worker.native import load_kernels", "treadle.bench", "public API"),
    ("import treadle.worker.sampler", "treadle.sim", "public API"),
    ("from treadle.models.loader import safetensors_files", "treadle.bench", "public API"),
    ("from treadle.core.kv_cache_manager import hash_block", "treadle.sim", "public API"),
    ("from treadle.server.dashboard_data import build_event", "treadle.bench", "public API"),
    ("from treadle.config import _help", "treadle.sim", "private name"),
    ("from treadle.engine.core import _helper", "treadle.bench", "private name"),
    ("from treadle.measure.report import _cell", "treadle.sim", "private name"),
    ("from treadle.bench import workloads", "treadle.sim", "imports treadle.bench"),
    ("from treadle.sim.hardware import load_hardware", "treadle.bench", "imports treadle.sim"),
    ("from treadle.bench.report import x", "treadle.measure", "imports treadle.bench"),
    ("def f(core):\n    return core.executor.worker.model", "treadle.bench", "executor.worker"),
    ("from . import fleet", "treadle.sim", "relative import"),
])
def test_the_check_refuses(source, package, why):
    problems = import_problems(source, package)
    assert len(problems) == 1 and why in problems[0], problems


@pytest.mark.parametrize("source, package", [
    ("from treadle import LLM, SamplingParams", "treadle.bench"),
    ("from treadle.engine.trace import read_trace", "treadle.sim"),
    ("from treadle.core.scheduler import Scheduler", "treadle.sim"),
    ("from treadle.router.routers import make_router", "treadle.sim"),
    ("from treadle.measure import workloads", "treadle.sim"),
    ("from treadle.sim.fleet import _START", "treadle.sim"),  # its own package
    ("import numpy as np\nfrom treadle.models.resolve import resolve_model", "treadle.bench"),
    ("def f(llm):\n    return llm.engine.executor.collective_rpc('describe')", "treadle.bench"),
])
def test_the_check_allows(source, package):
    assert import_problems(source, package) == []
