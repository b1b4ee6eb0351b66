"""Worker discovery: ``dns://`` workers and ``--workers-file``, with
requests in flight throughout.

The app runs in process (its lifespan and its ASGI calls driven here, on
both anyio backends) in front of real simulator processes. The fake
resolver answers as ``getaddrinfo`` does, ``(address, port)`` pairs: each
simulator is 127.0.0.1 on a port of its own.
"""

from __future__ import annotations

import os
import socket
import time

import anyio
import orjson
import pytest

from asgi_generate.server.app import App
from asgi_generate.config import Settings
from asgi_generate.workers.discovery import Discovery, Member
from asgi_generate.worker_specs import read_workers_file
from support import CONTINUATION, PROMPT, free_port, start_sim, stats

TOKENS = 16
BODY = orjson.dumps({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": TOKENS}, "stream": True})
CLIENTS = 6


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


@pytest.fixture(scope="module")
def three_sims():
    """Three SGLang simulators whose streams last ~0.3 s (20 ms per token)."""
    procs = [start_sim("sglang", itl_ms=20) for _ in range(3)]
    yield procs
    for p in procs:
        p.stop()


async def _call(app: App) -> tuple[int, list[int] | None]:
    """One streamed request through the app: its status and final output ids."""
    to_app, app_in = anyio.create_memory_object_stream(1)
    await to_app.send({"type": "http.request", "body": BODY, "more_body": False})
    out: list[dict] = []

    async def send(message: dict) -> None:
        out.append(message)

    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())]
    scope = {"type": "http", "method": "POST", "path": "/generate", "headers": headers, "query_string": b""}
    with anyio.fail_after(20):
        await app(scope, app_in.receive, send)
    to_app.close()
    body = b"".join(m.get("body", b"") for m in out[1:])
    events = [orjson.loads(b[6:]) for b in body.split(b"\n\n") if b.startswith(b"data: {")]
    return out[0]["status"], events[-1]["output_ids"] if events else None


class Fleet:
    """The app under test with its lifespan, a steady load of
    :data:`CLIENTS` streams, and what happened to each request."""

    def __init__(self, settings: Settings, resolver=None) -> None:
        self.app = App(settings, resolver=resolver) if resolver else App(settings)
        self.results: list[tuple[int, list[int] | None]] = []
        self.records = []
        self.drained: dict[str, float] = {}
        # /v1/models' entry of each worker as its drain began: read in the
        # drain itself, since its streams may all end before a test reads it
        self.at_drain: dict[str, dict] = {}
        finished = self.app.recorder.request_finished

        def record(st) -> None:
            self.records.append(st)
            finished(st)

        self.app.recorder.request_finished = record

    def workers(self) -> list[tuple[str, str, str]]:
        """``/v1/models``' workers: (id, url, state)."""
        return [(w["id"], w["url"], w["state"]) for w in self.app.models()["workers"]]

    async def until(self, predicate, timeout: float = 10.0) -> None:
        with anyio.fail_after(timeout):
            while not predicate():
                await anyio.sleep(0.01)

    async def run(self, script) -> None:
        to_life, life_in = anyio.create_memory_object_stream(4)
        life_out, from_life = anyio.create_memory_object_stream(4)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.app, {"type": "lifespan"}, life_in.receive, life_out.send)
            await to_life.send({"type": "lifespan.startup"})
            assert (await from_life.receive())["type"] == "lifespan.startup.complete"
            router = self.app.router
            drain = router.drain

            def spy(worker) -> None:  # when each worker stopped getting requests
                self.drained.setdefault(worker.id, time.monotonic())
                drain(worker)
                self.at_drain.setdefault(
                    worker.id, next(w for w in self.app.models()["workers"] if w["id"] == worker.id))

            router.drain = spy
            stop = anyio.Event()

            async def client() -> None:
                while not stop.is_set():
                    self.results.append(await _call(self.app))

            async with anyio.create_task_group() as load:
                for _ in range(CLIENTS):
                    load.start_soon(client)
                await script(self)
                stop.set()
            await to_life.send({"type": "lifespan.shutdown"})
            assert (await from_life.receive())["type"] == "lifespan.shutdown.complete"

    def check_none_lost(self) -> None:
        """Every request sent was answered whole, and recorded once."""
        assert len(self.results) >= CLIENTS
        assert self.results == [(200, CONTINUATION[:TOKENS])] * len(self.results)
        assert len(self.records) == len(self.results) == self.app.recorder.counters["request_items"]
        assert [st.status for st in self.records] == ["ok"] * len(self.records)
        assert all(len(st.attempts) == 1 for st in self.records)

    def on(self, wid: str) -> list:
        return [st for st in self.records if st.attempts[0].worker_id == wid]

    def check_drained(self, wid: str, sim, before: int) -> None:
        """No request was sent to ``wid`` after its drain began; its
        simulator (which had served ``before`` requests) saw exactly the
        requests the records put on it."""
        at = self.drained[wid]
        assert [st for st in self.on(wid) if st.t_dispatched > at] == []
        assert stats(sim)["generate_requests"] - before == len(self.on(wid))


@pytest.mark.e2e
@pytest.mark.anyio
async def test_dns_workers_join_after_their_probe_and_vanished_ones_drain(three_sims, caplog):
    a, b, c = three_sims
    before = {s.port: stats(s)["generate_requests"] for s in three_sims}
    answer = [("127.0.0.1", a.port), ("127.0.0.1", b.port)]
    lookups: list[tuple[str, int]] = []
    failing = False

    async def resolver(name: str, port: int) -> list[tuple[str, int]]:
        lookups.append((name, port))
        if failing:
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return list(answer)

    settings = Settings(workers=[("sglang", "dns://fleet.test:30000")], discovery_interval=0.05,
                        health_interval=0.05, sse_keepalive=0)
    fleet = Fleet(settings, resolver)

    async def script(f: Fleet) -> None:
        nonlocal answer, failing
        assert f.workers() == [("w0", a.url, "up"), ("w1", b.url, "up")]
        await f.until(lambda: len(f.results) >= 2 * CLIENTS)
        answer = [("127.0.0.1", b.port), ("127.0.0.1", c.port)]
        await f.until(lambda: "w0" in f.drained)
        draining = f.at_drain["w0"]
        assert draining["state"] == "draining"
        assert draining["outstanding"] > 0  # its streams carry on (check_none_lost: answered whole)
        f.app.recorder.metrics.refresh(f.app.router)  # out of the rotation: not "up" in /metrics either
        assert f.app.recorder.metrics.worker_up.labels("w0", a.url, "sglang", "aggregated")._value.get() == 0
        await f.until(lambda: f.workers() == [("w1", b.url, "up"), ("w2", c.url, "up")])
        assert sorted(f.app.stats()["workers"]) == sorted(f.app.aborts) == ["w1", "w2"]
        n = len(f.results)
        await f.until(lambda: len(f.results) >= n + 2 * CLIENTS)
        failing = True  # a resolver outage keeps the fleet
        n = len(lookups)
        await f.until(lambda: len(lookups) >= n + 3)
        assert f.workers() == [("w1", b.url, "up"), ("w2", c.url, "up")]

    await fleet.run(script)
    assert set(lookups) == {("fleet.test", 30000)}
    assert [r.getMessage() for r in caplog.records if r.name == "asgi_generate.discovery" and r.levelname == "WARNING"] \
        == ["resolving fleet.test failed ([Errno -3] Temporary failure in name resolution); keeping its 2 last address(es)"]
    fleet.check_none_lost()
    fleet.check_drained("w0", a, before[a.port])
    assert len(fleet.on("w2")) > 0
    assert len(fleet.on("w0")) + len(fleet.on("w1")) + len(fleet.on("w2")) == len(fleet.records)


def _write(path, text: str) -> None:
    """Replace ``path`` at once, as a config manager does."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


@pytest.mark.e2e
@pytest.mark.anyio
async def test_workers_file_edits_join_and_drain_workers(three_sims, tmp_path):
    a, b, c = three_sims
    before = {s.port: stats(s)["generate_requests"] for s in three_sims}
    path = tmp_path / "workers.json"
    _write(path, orjson.dumps({"workers": [f"sglang={a.url}", f"sglang={b.url}"]}).decode())
    settings = Settings(workers_file=str(path), discovery_interval=0.05, health_interval=0.05, sse_keepalive=0)
    fleet = Fleet(settings)

    async def script(f: Fleet) -> None:
        assert f.workers() == [("w0", a.url, "up"), ("w1", b.url, "up")]
        await f.until(lambda: len(f.results) >= 2 * CLIENTS)
        _write(path, orjson.dumps({"workers": [f"sglang={b.url}"]}).decode())
        await f.until(lambda: f.workers() == [("w1", b.url, "up")])
        n = len(f.results)
        await f.until(lambda: len(f.results) >= n + CLIENTS)
        _write(path, '{"workers": [')  # a broken edit keeps the fleet
        await anyio.sleep(0.3)
        assert f.workers() == [("w1", b.url, "up")]
        _write(path, orjson.dumps({"workers": [f"sglang={b.url}", f"sglang={c.url}"]}).decode())
        await f.until(lambda: f.workers() == [("w1", b.url, "up"), ("w2", c.url, "up")])
        n = len(f.results)
        await f.until(lambda: len(f.results) >= n + 2 * CLIENTS)

    await fleet.run(script)
    fleet.check_none_lost()
    fleet.check_drained("w0", a, before[a.port])
    assert len(fleet.on("w2")) > 0
    assert len(fleet.on("w0")) + len(fleet.on("w1")) + len(fleet.on("w2")) == len(fleet.records)


def test_workers_file_json_and_toml(tmp_path):
    js = tmp_path / "w.json"
    js.write_text('{"workers": ["sglang=http://10.0.0.1:30000", "vllm=dns://vllm.ns.svc:8000"],'
                  ' "prefill": ["sglang=http://10.0.0.2:30000?bootstrap_port=9000"],'
                  ' "decode": ["sglang=dns://decode:30000"]}')
    toml = tmp_path / "w.toml"
    toml.write_text('workers = ["sglang=http://10.0.0.1:30000", "vllm=dns://vllm.ns.svc:8000"]\n'
                    'prefill = ["sglang=http://10.0.0.2:30000?bootstrap_port=9000"]\n'
                    'decode = ["sglang=dns://decode:30000"]\n')
    want = [("aggregated", ("sglang", "http://10.0.0.1:30000")), ("aggregated", ("vllm", "dns://vllm.ns.svc:8000")),
            ("prefill", ("sglang", "http://10.0.0.2:30000?bootstrap_port=9000")),
            ("decode", ("sglang", "dns://decode:30000"))]
    assert read_workers_file(str(js)) == read_workers_file(str(toml)) == want


@pytest.mark.parametrize("name,text,error", [
    ("w.json", '{"workers": [', "does not parse: unexpected end of data: line 1 column 14 (char 13)"),
    ("w.toml", "workers = [", "does not parse: Invalid value (at end of document)"),
    ("w.json", '["sglang=http://h:1"]', "expected an object with workers, prefill, decode"),
    ("w.json", '{"worker": []}', "unknown key 'worker' (known: workers, prefill, decode)"),
    ("w.json", '{"workers": "sglang=http://h:1"}', "workers must be a list of PROTOCOL=URL strings"),
    ("w.json", '{"workers": ["sglang=ftp://h:1"]}',
     "worker 'sglang=ftp://h:1': expected an http(s)://HOST:PORT or dns://NAME:PORT URL"),
])
def test_bad_workers_files_are_one_line(tmp_path, name, text, error):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError) as exc:
        read_workers_file(str(path))
    assert str(exc.value) == f"workers file {str(path)!r}: {error}"
    with pytest.raises(ValueError) as exc:
        Settings(workers_file=str(path)).check()
    assert str(exc.value) == f"--workers-file (ASGI_GENERATE_WORKERS_FILE): workers file {str(path)!r}: {error}"


@pytest.mark.anyio
async def test_dns_members_keep_the_query_bracket_ipv6_and_survive_a_failed_lookup():
    answers = {"p": [("10.0.0.7", 30000), ("fd00::7", 30000)], "d": [("10.0.0.8", 30001)]}

    async def resolver(name: str, port: int) -> list[tuple[str, int]]:
        if name not in answers:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return answers[name]

    d = Discovery([("prefill", ("sglang", "dns://p:30000?bootstrap_port=9000")),
                   ("decode", ("sglang", "dns://d:30001")), ("decode", ("sglang", "http://10.0.0.8:30001"))],
                  resolver=resolver)
    want = [Member("prefill", "sglang", "http://10.0.0.7:30000?bootstrap_port=9000"),
            Member("prefill", "sglang", "http://[fd00::7]:30000?bootstrap_port=9000"),
            Member("decode", "sglang", "http://10.0.0.8:30001")]
    assert d.dynamic and await d.members() == want
    del answers["p"]
    assert await d.members() == want  # the last answer is kept
    assert not Discovery([("aggregated", ("sglang", "http://h:1"))]).dynamic


@pytest.mark.anyio
async def test_a_draining_worker_that_comes_back_keeps_its_id_and_a_drained_one_is_removed():
    from asgi_generate.workers.membership import Membership
    from asgi_generate.workers.router import Router

    a, b = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    answer = [("aggregated", ("sglang", a)), ("aggregated", ("sglang", b))]

    class Listed(Discovery):
        async def members(self):
            return [Member(role, p, u) for role, (p, u) in answer]

    router = Router([])
    busy: set[str] = {"w0"}
    removed: list[str] = []
    m = Membership(router, Listed([], workers_file="(listed by the test)"), interval=0.01, health_interval=100, busy=lambda w: w.id in busy,
                   on_remove=lambda w: removed.append(w.id))
    async with anyio.create_task_group() as tg:
        await tg.start(m.run)
        for w in router.workers:  # unreachable: pretend their probe passed
            w.healthy = True
        answer = answer[1:]
        with anyio.fail_after(5):
            while not router.workers[0].draining:
                await anyio.sleep(0.01)
        assert [router.pick("sglang").id for _ in range(3)] == ["w1"] * 3
        answer = [("aggregated", ("sglang", b)), ("aggregated", ("sglang", a))]
        with anyio.fail_after(5):
            while router.workers[0].draining:
                await anyio.sleep(0.01)
        assert sorted(router.pick("sglang").id for _ in range(2)) == ["w0", "w1"]
        answer = answer[:1]
        await anyio.sleep(0.2)
        assert [w.id for w in router.workers] == ["w0", "w1"] and removed == []  # still busy
        busy.clear()
        with anyio.fail_after(5):
            while removed != ["w0"]:
                await anyio.sleep(0.01)
        assert [(w.id, w.url) for w in router.workers] == [("w1", b)]
        tg.cancel_scope.cancel()
