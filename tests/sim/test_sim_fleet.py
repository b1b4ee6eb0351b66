"""``asgi-generate sim --workers N``: many simulated workers in one process,
each on its own port with its own state, answering exactly what a simulator
process of its own answers."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import anyio
import httpx
import orjson
import pytest

from asgi_generate.sim.app import SimApp
from asgi_generate.sim.fleet import SimFleet
from support import LOG_DIR, start_sim, wait_until

PROMPT = [5, 17, 301, 42, 9, 77, 1024, 3]
#: The engines' generate routes and one request each (16 tokens, EOS ignored).
REQUESTS = {
    "sglang": ("/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 16, "ignore_eos": True}}),
    "vllm": ("/inference/v1/generate", {"token_ids": PROMPT,
                                        "sampling_params": {"max_tokens": 16, "ignore_eos": True}}),
}


def _tokens(protocol: str, answer: dict) -> list[int]:
    return answer["output_ids"] if protocol == "sglang" else answer["choices"][0]["token_ids"]


class _Fleet:
    """``asgi-generate sim --workers n`` on free ports: :attr:`urls`, one per worker."""

    def __init__(self, tmp: pathlib.Path, n: int, extra: list[str]) -> None:
        urls_file = tmp / "urls"
        self.log = open(LOG_DIR / f"sim-fleet-{os.getpid()}-{id(self)}.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "asgi_generate", "sim", "--workers", str(n), "--port", "0",
             "--urls-file", str(urls_file), *extra],
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            wait_until(lambda: urls_file.exists() or self.proc.poll() is not None, timeout=30)
            assert self.proc.poll() is None, f"the fleet exited {self.proc.returncode}"
            self.urls = urls_file.read_text().split()
            assert len(self.urls) == n
            for url in self.urls:
                wait_until(lambda: _healthy(url), timeout=30)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


@pytest.mark.e2e
@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_fleet_workers_answer_as_a_single_simulator_and_keep_their_faults_apart(protocol, tmp_path):
    fleet = _Fleet(tmp_path, 3, ["--protocol", protocol, "--cache-tokens", "0"])
    single = None
    try:
        single = start_sim(protocol)
        path, body = REQUESTS[protocol]
        first, last = fleet.urls[0], fleet.urls[-1]
        answers = [httpx.post(u + path, json=body, timeout=10) for u in (first, last, single.url)]
        assert [a.status_code for a in answers] == [200, 200, 200]
        tokens = [_tokens(protocol, a.json()) for a in answers]
        assert len(tokens[2]) == 16
        assert tokens[0] == tokens[1] == tokens[2]

        # A fault armed on worker 0 fires there only; worker 2 stays healthy and answers.
        armed = httpx.post(first + "/sim/faults", json={"count": 1, "after_tokens": 0}, timeout=5)
        assert armed.status_code == 200
        stats = [httpx.get(u + "/sim/stats", timeout=5).json() for u in fleet.urls]
        assert [s["faults_armed"] for s in stats] == [1, 0, 0]
        again = httpx.post(last + path, json=body, timeout=10)
        assert again.status_code == 200 and _tokens(protocol, again.json()) == tokens[2]
        with pytest.raises(httpx.TransportError):
            httpx.post(first + path, json=body, timeout=10).read()
        assert [httpx.get(u + "/health", timeout=5).status_code for u in fleet.urls] == [503, 200, 200]
        # Each worker counts its own requests only.
        generate = f"POST {path}"
        stats = [httpx.get(u + "/sim/stats", timeout=5).json() for u in fleet.urls]
        assert [s["generate_requests"] for s in stats] == [2, 0, 2]
        assert [s["requests"].get(generate, 0) for s in stats] == [2, 0, 2]
        assert [s["faults_fired"] for s in stats] == [1, 0, 0]
    finally:
        fleet.stop()
        if single is not None:
            single.stop()


def _request(port: int, path: str, body: dict) -> tuple[dict, list[dict]]:
    scope = {"type": "http", "method": "POST", "path": path, "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json")], "server": ("127.0.0.1", port)}
    return scope, [{"type": "http.request", "body": orjson.dumps(body), "more_body": False}]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_fleet_routes_by_server_port_and_runs_every_lifespan(backend):
    workers = {7001: SimApp(cache_tokens=0), 7002: SimApp(cache_tokens=0)}
    fleet = SimFleet(workers)
    path, body = REQUESTS["sglang"]

    async def main() -> list[dict]:
        lifespan_in = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
        sent: list[dict] = []

        async def lifespan_receive() -> dict:
            return lifespan_in.pop(0)

        async def lifespan_send(message: dict) -> None:
            sent.append(message)

        with anyio.fail_after(5):
            await fleet({"type": "lifespan"}, lifespan_receive, lifespan_send)
            out: list[dict] = []
            scope, messages = _request(7002, path, body)

            async def send(message: dict) -> None:
                out.append(message)

            await fleet(scope, lambda: _pop(messages), send)
        return sent, out

    sent, out = anyio.run(main, backend=backend)
    assert sent == [{"type": "lifespan.startup.complete"}, {"type": "lifespan.shutdown.complete"}]
    assert out[0]["status"] == 200
    assert [w.engine.generate_requests for w in workers.values()] == [0, 1]
    assert [w.requests for w in workers.values()] == [{}, {"POST /generate": 1}]


async def _pop(messages: list[dict]) -> dict:
    if messages:
        return messages.pop(0)
    await anyio.sleep_forever()


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_fleet_workers_share_computed_steps_yet_answer_by_their_own_weights(backend):
    from asgi_generate.sim.tokenizer import SimTokenizer
    from support import asgi_json

    shared = SimTokenizer()
    a, b = SimApp(cache_tokens=0, tokenizer=shared), SimApp(cache_tokens=0, tokenizer=shared)
    own_default, own_v2 = SimApp(cache_tokens=0), SimApp(cache_tokens=0)
    # One step cache for the fleet's workers: its memory does not grow with the fleet.
    assert a.engine.model._cache is b.engine.model._cache
    assert a.engine.model._cache is not own_default.engine.model._cache
    a.engine.model.load_version("v2")
    own_v2.engine.model.load_version("v2")
    path, body = REQUESTS["sglang"]

    async def main() -> list[list[int]]:
        return [(await asgi_json(app, "POST", path, body))["output_ids"] for app in (a, b, own_v2, own_default)]

    on_a, on_b, v2, default = anyio.run(main, backend=backend)
    assert on_a == v2 and on_b == default and v2 != default and len(default) == 16
