"""Every engine the server can be handed implements EngineClient (treadle/engine/client.py)
member by member: each method present with a signature that accepts every call the
protocol allows (same parameters in the same order and kinds, the same defaults, extra
parameters only with defaults; an async generator where the protocol returns an
AsyncIterator), each property a property of the class or an attribute its constructor
sets. `isinstance` with runtime_checkable would only look at names, on a built engine.
Checked on the classes, so no model is loaded and no Ray cluster started."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

from treadle.distributed.pd_engine import PDEngine
from treadle.engine.async_engine import AsyncEngine
from treadle.engine.client import EngineClient

ray = pytest.importorskip("ray")
from treadle.integrations.ray_serve.client import ServeEngineClient  # noqa: E402

IMPLEMENTATIONS = [AsyncEngine, PDEngine, ServeEngineClient]


def protocol_members() -> dict[str, object]:
    """The protocol's own members: name -> property or function."""
    return {name: value for name, value in vars(EngineClient).items()
            if not name.startswith("_") and (isinstance(value, property) or callable(value))}


def constructor_attributes(cls: type) -> set[str]:
    """Names assigned as `self.<name>` in the __init__ of the class or of a base."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is None or not inspect.isfunction(init):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
        for node in ast.walk(tree):
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, ast.AnnAssign) else [])
            for target in targets:
                for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) \
                            and t.value.id == "self":
                        names.add(t.attr)
    return names


def signature_problem(name: str, wanted, actual) -> str | None:
    """Why `actual` cannot stand where the protocol's `wanted` is called, or None."""
    if not callable(actual):
        return f"{name}: not a method"
    want = list(inspect.signature(wanted).parameters.values())[1:]  # without self
    have = list(inspect.signature(actual).parameters.values())[1:]
    if len(have) < len(want):
        return f"{name}: takes {len(have)} parameters, the protocol {len(want)}"
    for w, h in zip(want, have):
        if (w.name, w.kind) != (h.name, h.kind):
            return f"{name}: parameter {h.name} ({h.kind}) where the protocol has " \
                   f"{w.name} ({w.kind})"
        if w.default is not inspect.Parameter.empty and h.default != w.default:
            return f"{name}: {h.name} defaults to {h.default!r}, the protocol's to " \
                   f"{w.default!r}"
    for extra in have[len(want):]:
        if extra.default is inspect.Parameter.empty and extra.kind not in (
                inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            return f"{name}: extra parameter {extra.name} without a default"
    streams = "AsyncIterator" in str(inspect.signature(wanted).return_annotation)
    if streams != inspect.isasyncgenfunction(actual):
        return f"{name}: {'not ' if streams else ''}an async generator"
    if inspect.iscoroutinefunction(actual) != inspect.iscoroutinefunction(wanted):
        return f"{name}: async where the protocol is not, or the other way round"
    return None


def conformance_problems(cls: type) -> list[str]:
    problems = []
    attributes = constructor_attributes(cls)
    for name, member in protocol_members().items():
        static = inspect.getattr_static(cls, name, None)
        if isinstance(member, property):
            if not isinstance(static, property) and name not in attributes:
                problems.append(f"{name}: neither a property nor set by __init__")
        elif static is None:
            problems.append(f"{name}: missing")
        elif isinstance(static, property):
            problems.append(f"{name}: a property where the protocol has a method")
        else:
            problem = signature_problem(name, member, getattr(cls, name))
            if problem:
                problems.append(problem)
    return problems


def test_the_protocol_states_what_the_server_uses_each_with_a_docstring():
    members = protocol_members()
    assert len(members) >= 25
    for name, member in members.items():
        doc = (member.fget if isinstance(member, property) else member).__doc__
        assert doc and doc.strip(), f"{name} has no docstring"
    for name in ("generate", "abort", "limits", "tokenizer", "model_name", "is_alive",
                 "metrics", "config", "get_lora", "record_steps", "num_in_flight", "error"):
        assert name in members


@pytest.mark.parametrize("cls", IMPLEMENTATIONS, ids=lambda c: c.__name__)
def test_each_engine_implements_the_protocol(cls):
    assert conformance_problems(cls) == []


def test_the_check_finds_missing_members_wrong_signatures_and_a_plain_coroutine():
    class Broken:
        def __init__(self) -> None:
            self.limits = None

        @property
        def is_alive(self) -> bool:
            return True

        def abort(self, request_id: str, why: str) -> None:
            pass

        def shutdown(self, timeout: float = 5.0) -> None:
            pass

        def abort_all(self, message: str) -> None:
            pass

        async def generate(self, request_id, prompt, prompt_token_ids, params, priority=0,
                           tenant=None, lora_request=None):
            return None

        lora_enabled = staticmethod(lambda: True)
        list_loras = 3

    problems = conformance_problems(Broken)
    for expected in ("abort: extra parameter why without a default",
                     "shutdown: timeout defaults to 5.0, the protocol's to 10.0",
                     "generate: not an async generator",
                     "list_loras: not a method", "start: missing",
                     "config: neither a property nor set by __init__",
                     "lora_enabled: neither a property nor set by __init__"):
        assert any(p.startswith(expected) for p in problems), (expected, problems)
    assert any(p.startswith("abort_all: parameter message") for p in problems)
    assert not any(p.startswith(("limits", "is_alive")) for p in problems)
