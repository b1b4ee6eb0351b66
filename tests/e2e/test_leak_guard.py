"""tests/leak_guard.py, on a run of its own (pytester, in a subprocess): a
fixture whose setup fails after starting a process, a test that leaves one
running and a grandchild whose parent exited are each stopped, and the run
fails naming who started each."""

from __future__ import annotations

import os
import pathlib

import pytest

from support import wait_until

pytestmark = pytest.mark.e2e

pytest_plugins = ["pytester"]

TESTS = pathlib.Path(__file__).parent.parent

LEAKY = '''
import subprocess, sys
import pytest

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]

def note(pid):
    with open("pids", "a") as f:
        f.write(f"{pid}\\n")

@pytest.fixture
def pair():
    note(subprocess.Popen(SLEEP).pid)
    raise RuntimeError("the second start failed")

def test_a_fixture_that_fails_after_a_start(pair):
    pass

def test_one_left_running():
    note(subprocess.Popen(SLEEP).pid)

def test_z_an_orphan():
    quiet = "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL"
    code = f"import subprocess; print(subprocess.Popen({SLEEP!r}, {quiet}).pid)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    note(int(out.stdout))
'''


def _running(pid: int) -> bool:
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_the_guard_stops_and_names_every_process_left_running(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    pytester.makepyfile(test_leaky=LEAKY)
    result = pytester.runpytest_subprocess("-p", "leak_guard", "-p", "no:cacheprovider", "-p", "no:xdist",
                                           "-p", "no:randomly", timeout=60)
    result.assert_outcomes(passed=2, errors=3)
    result.stdout.fnmatch_lines([
        "*RuntimeError: the second start failed*",
        "*LeftRunning: processes left running (now stopped):*",
        "*test_leaky.py::test_one_left_running left running: *time.sleep(60)*",
        "*LeftRunning: processes left running (now stopped):*",
        "*test_leaky.py::test_z_an_orphan left running: *time.sleep(60)*",
    ])
    pids = [int(p) for p in (pytester.path / "pids").read_text().split()]
    assert len(pids) == 3
    wait_until(lambda: not any(map(_running, pids)), timeout=10)  # the orphan's new parent reaps it
