"""A third engine installed from its own distribution, with no change to
the frontend: tests/data/toy_engine declares an engine description (entry
point group ``asgi_generate.engines``) and a codec for its generate format
(``asgi_generate.codecs``), and ships a tiny worker speaking it. The
distribution is installed into a temporary folder (never into this venv)
that reaches only the subprocesses through ``PYTHONPATH``; the frontend
serves the engine aggregated and as a P/D pair (the toy engine's pairs join
sequentially: the prefill leg's handle rides on the decode leg).
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
from contextlib import contextmanager

import httpx
import orjson
import pytest

from support import start_frontend, wait_until

pytestmark = pytest.mark.e2e

TOY = pathlib.Path(__file__).resolve().parents[1] / "data" / "toy_engine"
PROMPT = [3, 5, 7]
#: The toy worker's output: token i is (sum(prompt) + i) % 1000.
EXPECTED = [15, 16, 17, 18]


@pytest.fixture(scope="module")
def toy_path(tmp_path_factory) -> pathlib.Path:
    """The toy distribution, installed into a folder of its own (built from
    a copy, so the source tree gets no build files)."""
    root = tmp_path_factory.mktemp("toy")
    shutil.copytree(TOY, root / "src")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(root / "site"),
                    str(root / "src")], check=True, timeout=600, capture_output=True, stdin=subprocess.DEVNULL)
    return root / "site"


def env_with(path: pathlib.Path) -> dict[str, str]:
    existing = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": str(path) + (os.pathsep + existing if existing else "")}


@contextmanager
def toy_worker(path: pathlib.Path, role: str = "aggregated"):
    """A toy worker in ``role``; yields its URL."""
    proc = subprocess.Popen([sys.executable, "-m", "toy_engine.worker", "--role", role], stdout=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, env={**os.environ, **env_with(path)})
    try:
        port = int(proc.stdout.readline())  # the worker prints its port, then closes stdout
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(30)
        proc.stdout.close()


def served(url: str) -> int:
    return httpx.get(url + "/served", timeout=10).json()["served"]


def all_up(fe) -> list[tuple[str, str, str]]:
    workers = httpx.get(fe.url + "/v1/models", timeout=10).json()["workers"]
    return [(w["protocol"], w["role"], w["state"]) for w in workers]


def ask(fe) -> tuple[httpx.Response, list[bytes]]:
    """One unary and one streamed toy request."""
    unary = httpx.post(fe.url + "/toy/generate", json={"tokens": PROMPT, "max": 4}, timeout=30)
    with httpx.stream("POST", fe.url + "/toy/generate", json={"tokens": PROMPT, "max": 4, "stream": True},
                      timeout=30) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):].encode() for line in resp.iter_lines() if line.startswith("data: ")]
    return unary, events


STREAMED = [orjson.dumps({"t": [t], "done": "length" if i == 3 else None}) for i, t in enumerate(EXPECTED)] + [b"[DONE]"]


# The first test of the module also builds the toy distribution (pip, build
# isolation): minutes on a loaded machine, hence a longer hang bound.
@pytest.mark.timeout(300)
@pytest.mark.parametrize("worker_class", ["trio", "asyncio"])
def test_a_third_engine_from_its_own_distribution_is_served_aggregated(toy_path, worker_class):
    with toy_worker(toy_path) as url:
        fe = start_frontend([f"toy={url}"], worker_class=worker_class, env=env_with(toy_path), fork=False)
        try:
            wait_until(lambda: all_up(fe) == [("toy", "aggregated", "up")])
            codecs = subprocess.run([sys.executable, "-m", "asgi_generate", "codecs"], capture_output=True,
                                    text=True, timeout=60, env={**os.environ, **env_with(toy_path)})
            assert codecs.returncode == 0, codecs.stderr
            assert ["toy", "POST /toy/generate", "toy", "asgi-generate-toy-engine", "0.1.0"] in [
                re.split(r"\s{2,}", line) for line in codecs.stdout.splitlines()]
            engines = subprocess.run([sys.executable, "-m", "asgi_generate", "engines"], capture_output=True,
                                     text=True, timeout=60, env={**os.environ, **env_with(toy_path)})
            assert (engines.returncode, engines.stderr) == (0, "")
            assert [re.split(r"\s{2,}", line) for line in engines.stdout.splitlines()] == [
                ["NAME", "P/D", "SIMULATED", "GENERATE"], ["sglang", "concurrent", "yes", "/generate"],
                ["toy", "sequential", "no", "/toy_generate"], ["vllm", "sequential", "yes", "/inference/v1/generate"]]
            unary, events = ask(fe)
            assert unary.status_code == 200
            assert unary.json() == {"tokens": EXPECTED, "finish": "length"}
            assert events == STREAMED
            assert served(url) == 2
        finally:
            fe.stop()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("worker_class", ["trio", "asyncio"])
def test_a_third_engine_from_its_own_distribution_is_served_as_a_pd_pair(toy_path, worker_class):
    with toy_worker(toy_path, "prefill") as prefill, toy_worker(toy_path, "decode") as decode:
        fe = start_frontend([], worker_class=worker_class, env=env_with(toy_path), fork=False,
                            extra=["--prefill", f"toy={prefill}", "--decode", f"toy={decode}",
                                   "--disaggregation", "always"])
        try:
            wait_until(lambda: all_up(fe) == [("toy", "prefill", "up"), ("toy", "decode", "up")])
            unary, events = ask(fe)
            assert unary.status_code == 200
            assert unary.json() == {"tokens": EXPECTED, "finish": "length"}
            assert events == STREAMED
            # Each request ran one prefill leg and one decode leg carrying its handle.
            assert (served(prefill), served(decode)) == (2, 2)
        finally:
            fe.stop()
