"""The worker pool's Protocols (asgi_generate/workers/pool.py) against the
pool they describe and the tests' fakes of it (tests/fakes.py): every
member present, every method with the Protocol's parameters (names, kinds,
defaults) and the same sync/async kind."""

from __future__ import annotations

import inspect
from typing import Protocol

import pytest

from asgi_generate.workers.http import ConnectionPool, Response, _Exchange
from asgi_generate.workers.pool import WorkerExchange, WorkerPool, WorkerResponse
from fakes import AnsweringPool, CallPool, FakeExchange, FakePool, FakeResponse

IMPLEMENTATIONS = [
    (WorkerPool, ConnectionPool), (WorkerExchange, _Exchange), (WorkerResponse, Response),
    (WorkerPool, FakePool), (WorkerPool, AnsweringPool), (WorkerPool, CallPool), (WorkerExchange, FakeExchange), (WorkerResponse, FakeResponse),
]


def _attributes(protocol: type) -> set[str]:
    return set(protocol.__dict__.get("__annotations__", {}))


def _methods(protocol: type) -> dict[str, object]:
    return {n: v for n, v in vars(protocol).items()
            if inspect.isfunction(v) and (not n.startswith("__") or n in ("__aenter__", "__aexit__"))}


def _parameters(function) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


def mismatches(protocol: type, implementation: type) -> list[str]:
    """What ``implementation`` lacks or declares otherwise than ``protocol``:
    one line per member; empty when it conforms."""
    problems = []
    slots = set(getattr(implementation, "__slots__", ()))
    for name in sorted(_attributes(protocol)):
        # Instance attributes set in __init__ are not on the class: a slot,
        # a class default or an assignment in __init__ declares them.
        init = inspect.getsource(implementation.__init__) if "__init__" in vars(implementation) else ""
        if not (hasattr(implementation, name) or name in slots or f"self.{name} =" in init):
            problems.append(f"{name}: missing")
    for name, declared in sorted(_methods(protocol).items()):
        got = getattr(implementation, name, None)
        if got is None:
            problems.append(f"{name}: missing")
            continue
        if inspect.iscoroutinefunction(declared) != inspect.iscoroutinefunction(got):
            problems.append(f"{name}: {'async' if inspect.iscoroutinefunction(declared) else 'sync'} in the Protocol")
        if _parameters(declared) != _parameters(got):
            problems.append(f"{name}: {inspect.signature(got)} is not {inspect.signature(declared)}")
    return problems


@pytest.mark.parametrize(("protocol", "implementation"), IMPLEMENTATIONS,
                         ids=[f"{p.__name__}-{i.__name__}" for p, i in IMPLEMENTATIONS])
def test_implementation_has_every_member_and_signature_of_its_protocol(protocol, implementation):
    assert mismatches(protocol, implementation) == []


def test_a_fake_with_a_narrower_signature_or_a_missing_member_is_caught():
    class Narrow:
        def request(self, method, path, body, headers, head_deadline):
            return None

    class Reads(Protocol):
        status: int

        async def read(self, deadline: float = 0.0) -> bytes: ...

    class SyncRead:
        def read(self, deadline=0.0):
            return b""

    assert mismatches(WorkerPool, Narrow) == [
        "aclose: missing",
        "request: (self, method, path, body, headers, head_deadline) is not (self, method: 'bytes', path: 'bytes', "
        "body: 'bytes' = b'', headers: 'Iterable[tuple[bytes, bytes]]' = (), head_deadline: 'float' = inf, "
        "idempotent: 'bool' = False) -> 'WorkerExchange'",
    ]
    assert mismatches(Reads, SyncRead) == ["status: missing", "read: async in the Protocol"]
