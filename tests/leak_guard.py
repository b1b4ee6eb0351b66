"""No process left behind: a pytest plugin (loaded by tests/conftest.py).

Every process started while a test or a fixture runs (any
``subprocess.Popen``: a :class:`support.Proc`, a raw one, one started from a
thread) is recorded with its owner: the fixture being set up, or the test.
Its owner must stop it before the owner's scope ends:

- a fixture whose setup raises has what it started so far stopped at once
  (a second simulator that fails to start leaves no first one running);
- when a test's teardown ends, whatever the test, or a fixture whose scope
  ended with it (function, class, module, session), left running is
  stopped and that teardown fails, naming the owner and the command line;
- after the last test of a run (xdist: of each worker), every process
  still carrying the run's token in its environment (``TESTS_STARTED_BY``,
  inherited by grandchildren: embedded simulators, ``--workers``
  children, ``--detach`` daemons) is stopped, and the same teardown fails
  naming each one's owner.

A leak is a red suite, never a process found running after it.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import signal
import subprocess
import time
import uuid

import pytest

import forked
import support

#: The environment variable every process started under a test or fixture
#: inherits: the run's token and that owner's name.
STARTED_BY = "TESTS_STARTED_BY"  # not ASGI_GENERATE_*: the server refuses unknown settings
_TOKEN = uuid.uuid4().hex


class LeftRunning(RuntimeError):
    """A test or fixture finished with a process it started still running."""


@dataclasses.dataclass
class _Started:
    popen: subprocess.Popen | forked.Forked
    owner: object  # the FixtureDef or pytest.Item that started it
    scope: pytest.Item | pytest.Collector | pytest.Session  # it must be stopped when this node's teardown ends
    name: str  # the owner, as the report names it


_started: list[_Started] = []
_owners: list[tuple[object, object, str]] = []  # innermost last: the test, then the fixtures being set up
_leaks: list[str] = []


def _set_owner(owner: object | None, scope: object = None, name: str = "") -> None:
    if owner is None:
        _owners.pop()
    else:
        _owners.append((owner, scope, name))


def _recording(init):
    def init_and_record(popen, *args, **kwargs):
        if not _owners:
            return init(popen, *args, **kwargs)
        # The token goes in the child's environment, never in ours (a test
        # may check that nothing changed os.environ).
        env = kwargs.get("env")
        kwargs["env"] = {**(os.environ if env is None else env), STARTED_BY: f"{_TOKEN} {_owners[-1][2]}"}
        init(popen, *args, **kwargs)
        _started.append(_Started(popen, *_owners[-1]))

    return init_and_record


def pytest_configure(config):
    subprocess.Popen.__init__ = _recording(subprocess.Popen.__init__)
    forked.Forked.__init__ = _recording(forked.Forked.__init__)


def _command(popen: subprocess.Popen) -> str:
    args = popen.args if isinstance(popen.args, (list, tuple)) else [popen.args]
    return " ".join(map(str, args))[:300]


def _stop(popen: subprocess.Popen) -> None:
    """Stop ``popen`` as its :class:`support.Proc` would (terminate, then
    kill after 10 s)."""
    proc = next((p for p in support.Proc.live if p.proc is popen), None)
    if proc is not None:
        proc.stop()
    elif popen.poll() is None:
        popen.terminate()
        try:
            popen.wait(10)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait(10)


def _settle(ended, report: bool) -> None:
    """Forget the processes for which ``ended`` (a predicate on a record)
    holds; stop those still running (and, with ``report``, record each as
    a leak)."""
    keep = []
    for s in _started:
        if not ended(s):
            keep.append(s)
        elif s.popen.poll() is None:
            if report:
                _leaks.append(f"{s.name} left running: {_command(s.popen)}")
            _stop(s.popen)
    _started[:] = keep


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    # request.node: the node of the fixture's scope (the module, for a module-scoped one).
    _set_owner(fixturedef, request.node, f"fixture {fixturedef.argname!r} ({fixturedef.scope}) "
                                         f"set up for {request.node.nodeid or 'the session'}")
    try:
        return (yield)
    except BaseException:
        # Its setup failed (the error pytest reports): stop what it started so far.
        _settle(lambda s: s.owner is fixturedef, report=False)
        raise
    finally:
        _set_owner(None)


def _owned_by(item: pytest.Item):
    """Run one phase of ``item`` with the test as the owner of what starts."""
    _set_owner(item, item, item.nodeid)
    try:
        return (yield)
    finally:
        _set_owner(None)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _owned_by(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _owned_by(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    try:
        result = yield from _owned_by(item)
    finally:
        # pytest has torn down every node not above the next test: what they started must be stopped.
        still = set(nextitem.listchain()) if nextitem is not None else set()
        _settle(lambda s: s.scope not in still, report=True)
        if nextitem is None:
            _leaks.extend(_sweep())
    leaks, _leaks[:] = list(_leaks), []
    if leaks:
        raise LeftRunning("processes left running (now stopped):\n" + "\n".join(leaks))
    return result


def pytest_sessionfinish(session):
    # An interrupted run never tears its fixtures down: stop what is left.
    for s in _started:
        if s.popen.poll() is None:
            _stop(s.popen)
    _sweep()


def _sweep() -> list[str]:
    """Stop every process of this run still alive (by the token in its
    environment, so grandchildren too); what each was, and who started it."""
    found = {}
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        mark = next((v for v in env if v.startswith(f"{STARTED_BY}={_TOKEN} ".encode())), None)
        if mark is not None:
            owner = mark.decode(errors="replace").split(" ", 1)[1]
            found[int(entry.name)] = f"{owner} left running: {cmd[:300]}"
    for sig in (signal.SIGTERM, signal.SIGKILL) if found else ():
        for pid in found:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(map(_alive, found)):
            time.sleep(0.05)
    return list(found.values())


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has ended; its parent reaps it)."""
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
