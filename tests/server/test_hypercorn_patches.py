"""hypercorn's patches (asgi_generate.server.hypercorn.patches): checked
against the installed hypercorn and installed all together, or, on any
mismatch, not at all: one WARNING naming it, and hypercorn as released with
a guard task per request. And the lifespan state: a copy per request on
every worker class."""

from __future__ import annotations

import ast
import configparser
import importlib
import logging
import os
import pathlib
import re
import socket
import subprocess
import sys

import h11
import httpx
import orjson
import pytest

from asgi_generate.server.hypercorn import patches
from hypercorn_mismatch import MISMATCHES, apply, environment
from state_app import lifespan
from support import RawClient, listening_socket, post, start_frontend, start_sim, stats, tcp_states, wait_until

TESTS = pathlib.Path(__file__).resolve().parents[1]  # the shared helpers (state_app.py, reset_app.py)

WARNING = ("hypercorn patches not installed: {}; serving with stock hypercorn (a guard task per request, "
           "the bugs of asgi_generate/server/hypercorn/UPSTREAM.md unfixed)")


def _replaced() -> dict:
    """What each global the patches replace holds now."""
    return {(module, name): getattr(importlib.import_module(module), name) for module, name in patches.REPLACED}


def test_the_pinned_hypercorn_matches_the_patches():
    assert patches.mismatches() == []


def test_setup_cfg_pins_the_releases_the_patches_were_written_for():
    cfg = configparser.ConfigParser()
    cfg.read(TESTS.parent / "setup.cfg")
    requires = [line.strip() for line in cfg["options"]["install_requires"].splitlines()]
    assert [r for r in requires if r.startswith("hypercorn")] == ["hypercorn" + patches.SUPPORTED]


def test_mismatches_name_every_difference(monkeypatch):
    for kind in MISMATCHES:
        apply(kind, monkeypatch.setattr, monkeypatch.delattr)
    import hypercorn.protocol.h2 as protocol_h2
    from hypercorn.protocol.http_stream import HTTPStream

    monkeypatch.setattr(protocol_h2, "HTTPStream", type("SomeoneElses", (HTTPStream,), {}))
    assert patches.mismatches() == [
        MISMATCHES["version"][1], MISMATCHES["signature"][1], MISMATCHES["missing"][1],
        "hypercorn.protocol.h2.HTTPStream is not hypercorn.protocol.http_stream.HTTPStream",
    ]


def test_a_patch_module_that_no_longer_loads_is_a_mismatch(monkeypatch):
    # Every hypercorn name the patches import is checked before they load
    # (test_every_hypercorn_name_the_patches_touch_is_checked): what stops
    # one loading now is a name of ours.
    from asgi_generate.request import watchdog

    monkeypatch.delattr(watchdog, "RECEIVE_NOWAIT")
    monkeypatch.delitem(sys.modules, "asgi_generate.server.hypercorn.fixes", raising=False)  # loaded afresh
    [found] = patches.mismatches()
    assert found.startswith("asgi_generate.server.hypercorn.fixes does not import: "
                            "cannot import name 'RECEIVE_NOWAIT' from 'asgi_generate.request.watchdog'")


def _touched() -> tuple[set[str], dict[str, set[str]]]:
    """What the patch modules touch of hypercorn, read from their source:
    the dotted path of every name they import from it, every attribute
    read off one of those names, every setting read off a ``config``, and
    every ``self.`` attribute of a hypercorn subclass of theirs that the
    hypercorn base has on the class (a path) or assigns in its source (an
    instance attribute, by class)."""
    paths: set[str] = set()
    instance: dict[str, set[str]] = {}
    for module in patches._PATCH_MODULES:
        tree = ast.parse((pathlib.Path(patches.__file__).parent / f"{module}.py").read_text())
        local = {alias.asname or alias.name: f"{node.module}.{alias.name}"
                 for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hypercorn")
                 for alias in node.names}
        paths |= set(local.values())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                dotted = ast.unparse(node)
                head = dotted.split(".")[0]
                if head in local and re.fullmatch(r"[\w.]+", dotted):
                    paths.add(local[head] + dotted[len(head):])
                if isinstance(node.value, (ast.Name, ast.Attribute)) and ast.unparse(node.value).split(".")[-1] == "config":
                    paths.add(f"hypercorn.config.Config.{node.attr}")
            if isinstance(node, ast.ClassDef):
                bases = [local[b.id] for b in node.bases if isinstance(b, ast.Name) and b.id in local]
                bases += [local[b.value.id] + "." + b.attr for b in node.bases
                          if isinstance(b, ast.Attribute) and isinstance(b.value, ast.Name) and b.value.id in local]
                for base in bases:
                    cls = patches._resolve(base)
                    for attr in {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
                                 and isinstance(n.value, ast.Name) and n.value.id == "self"}:
                        if hasattr(cls, attr):
                            if not attr.startswith("__"):
                                paths.add(f"{base}.{attr}")
                        elif attr in patches._assigned(cls):
                            instance.setdefault(base, set()).add(attr)
    return paths, instance


def test_every_hypercorn_name_the_patches_touch_is_checked():
    paths, instance = _touched()
    checked = set(patches.EXPECTED)
    # A module is checked through the names under it.
    unchecked = {p for p in paths if p not in checked and not any(c.startswith(p + ".") for c in checked)}
    assert sorted(unchecked) == []
    assert {cls: sorted(names - set(patches.INSTANCE_ATTRIBUTES.get(cls, ()))) for cls, names in instance.items()} == {
        cls: [] for cls in instance}


def test_the_replaced_init_sets_every_attribute_hypercorns_did():
    from asgi_generate.server.hypercorn import trio_serve

    (path, names), = patches.REPLACED_INITS.items()
    assert patches._assigned(trio_serve.TCPServer.__init__) >= set(names) == patches._assigned(patches._resolve(path).__init__)


def test_a_missing_hypercorn_attribute_is_named(monkeypatch):
    import hypercorn.config
    import hypercorn.protocol.events as events
    import hypercorn.utils

    monkeypatch.delattr(hypercorn.utils, "parse_socket_addr")
    monkeypatch.delattr(events, "EndBody")
    monkeypatch.delattr(hypercorn.config.Config, "keep_alive_max_requests")
    assert patches.mismatches() == [
        "hypercorn.protocol.events.EndBody is missing",
        "hypercorn.config.Config.keep_alive_max_requests is missing",
        "hypercorn.utils.parse_socket_addr is missing",
    ]


def test_an_instance_attribute_no_longer_set_or_a_new_one_is_named(monkeypatch):
    import hypercorn.protocol
    import hypercorn.protocol.h11
    import hypercorn.trio.run
    import hypercorn.trio.tcp_server

    h11_protocol = hypercorn.protocol.h11.H11Protocol

    class H11Protocol(h11_protocol):  # as if a release kept no keep_alive_requests
        def __init__(self, app, config, context, task_group, connection_state, ssl, client, server, send):
            self.app = app
            self.config = config
            self.connection = None
            self.send = send

    tcp_server = hypercorn.trio.tcp_server.TCPServer

    class TCPServer(tcp_server):  # as if a release set one attribute more
        def __init__(self, app, config, context, state, stream):
            self.app = self.config = self.context = self.idle_task = self.send_lock = self.state = None
            self.stream = stream
            self.idle_since = 0.0

        async def run(self):
            self.protocol = self._task_group = None

    for module in (hypercorn.protocol, hypercorn.protocol.h11):
        monkeypatch.setattr(module, "H11Protocol", H11Protocol)
    for module in (hypercorn.trio.run, hypercorn.trio.tcp_server):
        monkeypatch.setattr(module, "TCPServer", TCPServer)
    assert patches.mismatches() == [
        "hypercorn.protocol.h11.H11Protocol sets no attribute keep_alive_requests",
        "hypercorn.trio.tcp_server.TCPServer.__init__ sets idle_since, which the patches' replacement does not",
    ]


def test_a_mismatch_patches_nothing_and_warns_once(monkeypatch, caplog):
    monkeypatch.setattr(patches, "_installed", None)
    apply("signature", monkeypatch.setattr, monkeypatch.delattr)
    before = _replaced()
    with caplog.at_level(logging.WARNING, logger="asgi_generate.server.hypercorn"):
        assert patches.install(send_errors=True) is False
        assert patches.install(send_errors=False) is False
    assert _replaced() == before
    assert [(r.name, r.levelname, r.getMessage()) for r in caplog.records] == [
        ("asgi_generate.server.hypercorn", "WARNING", WARNING.format(MISMATCHES["signature"][1]))]


@pytest.mark.e2e
def test_importing_the_server_patches_nothing():
    # Only the entry points install (serving.run, and the hypercorn entry
    # module asgi.py, whose import is hypercorn loading the app).
    code = """if True:
        import importlib, pkgutil
        import asgi_generate.server as server
        from asgi_generate.server.hypercorn import patches
        for info in pkgutil.walk_packages(server.__path__, "asgi_generate.server."):
            if info.name != "asgi_generate.server.asgi":
                importlib.import_module(info.name)
        print(all(getattr(importlib.import_module(module), name) is patches._resolve(original)
                  for (module, name), original in patches.REPLACED.items()))
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["True"], out.stderr


# -- a frontend under a hypercorn the patches do not match ------------------------


@pytest.fixture(scope="module")
def slow_sim():
    # The engine's own abort of a vanished client waits 60 s: a job that
    # stops was stopped by the frontend's abort.
    sim = start_sim(ttft_ms=50, itl_ms=40, extra=["--disconnect-abort-s", "60"])
    yield sim
    sim.stop()


def _statuses_for_an_upload_over_the_cap(url: str) -> list[int]:
    """The statuses answered to a head that announces a body over the
    frontend's 1,000-byte cap and expects ``100 Continue`` (no body sent)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = h11.Connection(h11.CLIENT)
    statuses: list[int] = []
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(conn.send(h11.Request(method="POST", target="/generate", headers=[
            ("host", "127.0.0.1"), ("content-type", "application/json"), ("content-length", "2000"),
            ("expect", "100-continue")])))
        while not statuses or statuses[-1] < 200:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(sock.recv(65536))
            elif isinstance(event, (h11.InformationalResponse, h11.Response)):
                statuses.append(event.status_code)
    return statuses


def _serves_as_released(url: str, sim) -> None:
    ok = post(url, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3}})
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 3
    # hypercorn's own early 100 (UPSTREAM.md): not patched, not half-patched.
    assert _statuses_for_an_upload_over_the_cap(url) == [100, 413]
    # A client that leaves mid-stream: its request's guard task sees the
    # disconnect on receive(), and the engine is aborted.
    running = set(stats(sim)["running_rids"])
    client = RawClient(url)
    client.send(orjson.dumps({"input_ids": [3, 4, 5], "stream": True,
                              "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}))
    assert len(client.events(2)) == 2 and client.status == 200
    [rid] = set(stats(sim)["running_rids"]) - running
    client.close()
    wait_until(lambda: rid in stats(sim)["aborted_rids"])


def _patch_warnings(log: str) -> list[str]:
    return [line for line in log.splitlines() if "hypercorn patches" in line]


@pytest.mark.e2e
@pytest.mark.parametrize("kind,worker_class", [("missing", "trio"), ("signature", "asyncio"), ("version", "uvloop")])
def test_a_mismatched_hypercorn_serves_as_released_after_one_warning(slow_sim, tmp_path, kind, worker_class):
    fe = start_frontend([f"sglang={slow_sim.url}"], worker_class=worker_class, extra=["--max-body-bytes", "1000"],
                        env=environment(kind, tmp_path))
    try:
        _serves_as_released(fe.url, slow_sim)
    finally:
        fe.stop()
    [line] = _patch_warnings(fe.log_path.read_text())
    assert line.endswith(" WARNING asgi_generate.server.hypercorn: " + WARNING.format(MISMATCHES[kind][1]))


@pytest.mark.e2e
@pytest.mark.parametrize("kind", [None, "missing"])
def test_stats_say_whether_hypercorn_serves_patched(slow_sim, tmp_path, kind):
    """A patch that could not apply shows in /stats too, not only in the
    start-up WARNING."""
    fe = start_frontend([f"sglang={slow_sim.url}"], env=environment(kind, tmp_path) if kind else None)
    try:
        got = httpx.get(fe.url + "/stats", timeout=5).json()["hypercorn_patches"]
    finally:
        fe.stop()
    assert got == ({"installed": True, "mismatches": []} if kind is None else
                   {"installed": False, "mismatches": [MISMATCHES[kind][1]]})


@pytest.mark.e2e
def test_hypercorn_run_yourself_under_a_mismatch_warns_once_and_serves(slow_sim, tmp_path):
    sock = listening_socket()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    env = {**os.environ, **environment("version", tmp_path), "ASGI_GENERATE_WORKERS": f"sglang={slow_sim.url}",
           "ASGI_GENERATE_MAX_BODY_BYTES": "1000", "ASGI_GENERATE_HEALTH_INTERVAL": "0.2"}
    log = tmp_path / "hypercorn.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "hypercorn", "-k", "trio", "-b", f"fd://{sock.fileno()}",
                                 "asgi_generate.server.asgi:app"], pass_fds=[sock.fileno()], env=env,
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    sock.close()
    try:
        wait_until(lambda: _get(url + "/health") == 200, timeout=30)
        _serves_as_released(url, slow_sim)
    finally:
        proc.terminate()
        proc.wait(20)
    [line] = _patch_warnings(log.read_text())
    assert line.endswith(" [WARNING] asgi_generate.server.hypercorn: " + WARNING.format(MISMATCHES["version"][1]))


def _get(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=1).status_code
    except httpx.HTTPError:
        return None


# -- the lifespan state ---------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.parametrize("worker_class", ["trio", "asyncio", "uvloop"])
def test_each_request_gets_its_own_copy_of_the_lifespan_state(worker_class):
    sock = listening_socket()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    proc = subprocess.Popen([sys.executable, str(TESTS / "state_app.py"), "--fd", str(sock.fileno()),
                             "--worker-class", worker_class], pass_fds=[sock.fileno()], stdin=subprocess.DEVNULL)
    sock.close()
    try:
        wait_until(lambda: _get(url + "/look") == 200, timeout=30)
        with httpx.Client(timeout=10) as one, httpx.Client(timeout=10) as other:  # a connection each
            assert one.get(url + "/mutate").json() == ["started"]
            assert other.get(url + "/look").json() == ["started"]
            assert one.get(url + "/look").json() == ["started"]
    finally:
        proc.terminate()
        proc.wait(20)


# -- the connection reset ----------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.parametrize("worker_class", ["trio", "asyncio", "uvloop"])
def test_a_connection_reset_drops_the_queue_and_ends_a_stuck_write(worker_class):
    """An app cuts off a client that stopped reading (tests/reset_app.py):
    the reset ends the send stuck on it (hypercorn's trio worker shields
    it), and the server's socket, with what was queued for the client, is
    gone at once; the client reads a reset."""
    sock = listening_socket()
    port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, str(TESTS / "reset_app.py"), "--fd", str(sock.fileno()),
                             "--worker-class", worker_class], pass_fds=[sock.fileno()], stdin=subprocess.DEVNULL)
    sock.close()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _get(url + "/cut") == 200, timeout=30)
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.settimeout(10)
        client.connect(("127.0.0.1", port))
        client.sendall(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n")
        peer = client.getsockname()[1]
        cut = wait_until(lambda: (c := httpx.get(url + "/cut", timeout=5).json())["returned_s"] is not None and c,
                         timeout=20)
        assert cut["reset"] is True and cut["returned_s"] < 0.5
        assert tcp_states(port, peer) == []
        with pytest.raises(ConnectionResetError):
            while client.recv(65536):  # what the client's own buffer held, then the reset
                pass
        client.close()
    finally:
        proc.terminate()
        proc.wait(20)


# -- what a served request leaves to the cycle collector -----------------------------


async def _fixed_answer(scope: dict, receive, send) -> None:
    if scope["type"] == "lifespan":
        await lifespan(receive, send)
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"{}"})


def _ours(obj) -> bool:
    module = type(obj).__module__ or ""
    owner = getattr(obj, "__self__", None)  # a bound method: whose
    return module.startswith(("asgi_generate", "hypercorn")) or (owner is not None and _ours(owner))


@pytest.mark.parametrize("worker_class", ["asyncio", "trio"])
def test_a_served_request_leaves_no_cyclic_garbage(worker_class):
    """Each request's stream, its app wrapper, receive and extensions are
    freed by reference counting once the request is done: left in reference
    cycles (the stream's extensions held bound methods of the stream; its
    app wrapper held the stream), 21 objects a request waited for the cycle
    collector, whose runs cost the asyncio hop about 30 µs a unary request
    (bench/README.md, bench_hop_split.py)."""
    import gc

    import anyio

    from asgi_generate.server.serving import hypercorn_config

    patches.install(send_errors=True)
    if worker_class == "trio":
        from asgi_generate.server.hypercorn.graceful import trio_serve as serve
    else:
        from asgi_generate.server.hypercorn.asyncio_serve import serve
    sock = listening_socket()
    port = sock.getsockname()[1]
    config = hypercorn_config(fd=sock.fileno(), log_level="warning")
    request = b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}"
    left: list = []

    async def main() -> None:
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: serve(_fixed_answer, config, shutdown_trigger=stop.wait))
            client = await anyio.connect_tcp("127.0.0.1", port)
            for n in range(12):
                if n == 2:  # after the warm-up: what the requests after it leave
                    gc.collect()
                    gc.set_debug(gc.DEBUG_SAVEALL)
                await client.send(request)
                answer = b""
                while not answer.endswith(b"\r\n\r\n{}"):
                    answer += await client.receive()
                assert answer.startswith(b"HTTP/1.1 200 ")
            gc.collect()
            left.extend(o for o in gc.garbage if _ours(o))
            await client.aclose()
            stop.set()

    try:
        anyio.run(main, backend=worker_class)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        sock.detach()  # hypercorn closed the socket of the fd it was given
    assert [type(o).__qualname__ for o in left] == []
