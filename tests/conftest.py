"""Shared fixtures (simulator and frontend processes for the whole session)
and the ``e2e`` guard: a test that starts a process must be marked ``e2e``,
so that ``pytest -m "not e2e"`` starts none. An unmarked test fails when it,
or a fixture set up for it, starts one; in a whole run a session fixture an
e2e test started first is already up, so the ``not e2e`` run is the check."""

from __future__ import annotations

import compileall
import functools
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

import forked
from support import start_frontend, start_sim

# No process left behind: a leak fails the run, naming who started it.
pytest_plugins = ["leak_guard"]


class ProcessInUnitTest(RuntimeError):
    """A test not marked ``e2e`` tried to start a process."""


# The test whose phase is running while unmarked (None: no guard). Set by the
# hook wrappers below, read by the patched process starts.
_unit_test: pytest.Item | None = None
_started: list[str] = []


def _guarded(start):
    def start_or_refuse(*args, **kwargs):
        if _unit_test is not None:
            argv = args[1] if len(args) > 1 else None  # Popen._execute_child's, Forked's, posix_spawn's
            what = " ".join(map(str, argv)) if isinstance(argv, (list, tuple)) else start.__name__
            _started.append(what)
            raise ProcessInUnitTest(f"{_unit_test.nodeid} is not marked e2e but started a process: {what}")
        return start(*args, **kwargs)

    return start_or_refuse


def _one_default_ssl_context() -> None:
    """Every httpx client the tests make with the default ``verify=True``
    (each ``httpx.get``/``post``/``stream``: thousands a run) shares one SSL
    context: making one loads certifi's CA bundle, ~30 ms of CPU each."""
    from httpx._transports import default

    make = default.create_ssl_context
    shared = functools.cache(lambda trust_env: make(verify=True, trust_env=trust_env))

    def create_ssl_context(verify=True, cert=None, trust_env=True):
        if verify is True and cert is None:
            return shared(trust_env)
        return make(verify=verify, cert=cert, trust_env=trust_env)

    default.create_ssl_context = create_ssl_context


def _bytecode_cache() -> None:
    """Where the environment says not to write bytecode
    (``PYTHONDONTWRITEBYTECODE``), cache it outside the tree instead, in
    one folder for every run (``PYTHONPYCACHEPREFIX``, unless set: the
    temporary folder's ``asgi-generate-pycache-UID``), for this process and
    all it starts: the xdist workers (started after this), their fork
    servers and every process a test starts. Else each of them compiles
    the project from source, and each test process rewrites every test
    module's asserts (~6 s of CPU a test process, 3 per core). A cached
    file is used only while its source's size and modification time match
    (Python's and pytest's check), so an edit is never run stale. The
    modules imported so far and the project's are compiled here once, so
    even a first run's test processes find them compiled."""
    if not os.environ.pop("PYTHONDONTWRITEBYTECODE", None):
        return
    sys.dont_write_bytecode = False
    if "PYTHONPYCACHEPREFIX" in os.environ:
        sys.pycache_prefix = os.environ["PYTHONPYCACHEPREFIX"]
    else:
        temp = pathlib.Path(tempfile.gettempdir()).resolve()
        ours = temp / f"asgi-generate-pycache-{os.getuid()}"
        os.environ["PYTHONPYCACHEPREFIX"] = sys.pycache_prefix = str(ours)
        # Sources under the temporary folder (a test's pip builds and
        # installs) never come back: what earlier runs cached of them goes,
        # so the cache stays the size of one run's.
        shutil.rmtree(ours.joinpath(*temp.parts[1:]), ignore_errors=True)
    for module in list(sys.modules.values()):
        source = getattr(module, "__file__", None)
        if source and source.endswith(".py"):
            compileall.compile_file(source, quiet=2)
    root = pathlib.Path(__file__).parent.parent
    for folder in ("asgi_generate", "codecs", "tests"):  # a test module's rewritten code is pytest's own file
        compileall.compile_dir(root / folder, quiet=2, rx=re.compile(r"[/\\]test_[^/\\]*\.py$"))


def usable_cores() -> int:
    """The cores this process may use: its CPU affinity (a container's
    cpuset, not the host's count), capped by a cgroup CPU quota (v2
    ``cpu.max``, v1 ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``),
    rounded up; at least 1."""
    cores = len(os.sched_getaffinity(0))
    try:
        quota, period = _read("/sys/fs/cgroup/cpu.max").split()
    except (OSError, ValueError):
        try:
            quota, period = _read("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), _read("/sys/fs/cgroup/cpu/cpu.cfs_period_us")
        except OSError:
            quota, period = "max", "1"
    if quota not in ("max", "-1"):
        cores = min(cores, -(-int(quota) // int(period)))
    return max(1, cores)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


@pytest.hookimpl(optionalhook=True)  # xdist's hook: unknown when run with -p no:xdist
def pytest_xdist_auto_num_workers(config):
    # ``-n auto``: three test processes per core the run may use (xdist's
    # own count is psutil's physical cores of the whole host when psutil is
    # installed, else the affinity). Most e2e tests wait on the simulators
    # and servers they start (starts, streams at a set inter-token latency,
    # pauses and loads of set lengths): on 2 cores 3,630 tests took 312 s
    # with two per core and 292 s with three. xdist's
    # PYTEST_XDIST_AUTO_NUM_WORKERS still overrides it.
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook reads it
    return 3 * usable_cores()


def pytest_configure(config):
    _bytecode_cache()
    _one_default_ssl_context()
    # Every way a test, or the server code it runs in-process, starts a
    # process: subprocess (and so asyncio's, trio's and anyio's process
    # APIs, which all make a subprocess.Popen), fork, posix_spawn, and a
    # fork of the fork server (forked.py).
    subprocess.Popen._execute_child = _guarded(subprocess.Popen._execute_child)
    forked.Forked.__init__ = _guarded(forked.Forked.__init__)
    for name in ("fork", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            setattr(os, name, _guarded(getattr(os, name)))


def _phase(item: pytest.Item):
    """Run one phase (setup, call, teardown: a session fixture starts its
    processes in the setup of the first test that uses it) under the guard
    unless ``item`` is marked e2e; fail it if it started a process, even
    when the code that tried caught the refusal."""
    global _unit_test
    if item.get_closest_marker("e2e") is not None:
        return (yield)
    _unit_test, _started[:] = item, []
    try:
        result = yield
    finally:
        _unit_test = None
    if _started:
        raise ProcessInUnitTest(f"not marked e2e but started a process: {', '.join(_started)}")
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _phase(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _phase(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    return (yield from _phase(item))


@pytest.fixture(scope="session")
def sims():
    """Two SGLang simulators (no TTFT/ITL delay)."""
    procs = [start_sim("sglang"), start_sim("sglang")]
    yield procs
    for p in procs:
        p.stop()


@pytest.fixture(scope="session", params=["trio", "asyncio"])
def frontend(request, sims):
    """The frontend in front of both simulators, once per worker class."""
    proc = start_frontend([f"sglang={s.url}" for s in sims], worker_class=request.param)
    yield proc
    proc.stop()
