"""Process and HTTP helpers for the end-to-end tests.

Every server runs as its own process on a loopback socket bound here and
passed by file descriptor (no port races), with its output in a log file, and
is stopped by the fixture that started it.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import math
import os
import pathlib
import re
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from typing import Iterator

import anyio
import h11
import httpx
import orjson

import forked

LOG_DIR = pathlib.Path(tempfile.mkdtemp(prefix="asgi-generate-tests-"))

# A prompt and the simulator model's greedy continuation of it (either
# protocol), ending with EOS (id 2).
PROMPT = [1, 2, 3, 400]
CONTINUATION = [
    2358, 1262, 978, 1133, 1311, 3699, 2777, 1804, 1587, 3968, 428, 1520,
    1419, 1010, 3152, 3984, 3773, 1871, 2821, 3886, 2498, 1623, 1414, 2,
]


@functools.lru_cache(maxsize=1)
def _sim_model():
    from asgi_generate.sim.tokenizer import SimTokenizer

    tok = SimTokenizer()
    return tok.model(), tok.eos_id


def sampled(prompt: list[int], sample: int, count: int, ignore_eos: bool = False,
            version: str = "default") -> list[int]:
    """The simulator model's parallel sample ``sample`` of ``prompt`` under
    weight ``version``: its first ``count`` tokens (fewer when it ends with
    EOS first, unless ``ignore_eos``); sample 0 is the greedy continuation."""
    from asgi_generate.sim.model import version_origin

    model, eos = _sim_model()
    state, out = model.fold(prompt, version_origin(version)), []
    while len(out) < count:
        out.append(model.step(model.sampled(state, sample)).token)
        state = model.advance(state, out[-1])
        if out[-1] == eos and not ignore_eos:
            break
    return out


def campaign_size(suite: int, full: int) -> int:
    """A campaign's size: ``suite``, the smallest that still catches its
    bug class, or ``full`` when ``CAMPAIGN_SIZE=full`` (what
    bench/bench_campaigns.py sets)."""
    return full if os.environ.get("CAMPAIGN_SIZE") == "full" else suite


def _own_ports() -> Iterator[int]:
    """This test process's share of the ports below the kernel's ephemeral
    range, from a point its id picks, each once. A port ``bind(0)`` gave
    out and let go may be handed out again at once, as another process's
    listening port or a connection's local one (a test that then starts a
    process on it, or counts on nothing answering there, meets a
    stranger): the kernel never hands out these. The xdist workers split
    them, so no two test processes pick the same."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral, last = (int(n) for n in f.read().split()[:2])
    except (OSError, ValueError):
        ephemeral, last = 32768, 60999  # Linux's default
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
    return port_share(ephemeral, last, workers, worker, os.getpid())


def port_share(ephemeral: int, last: int, workers: int, worker: int, pid: int) -> Iterator[int]:
    """Test process ``worker``'s (of ``workers``) share of the ports the
    kernel's ephemeral range (``ephemeral`` to ``last``) leaves out:
    12288 below it, else (a range from 1024 up leaves none there) those
    above it; each once, from a point ``pid`` picks."""
    low = max(1024, ephemeral - 12288)
    if (ephemeral - low) // max(workers, 1) == 0:
        low, ephemeral = last + 1, 65536  # nothing below the range: above it
    share = (ephemeral - low) // max(workers, 1)
    if share == 0:
        raise RuntimeError(f"no port outside the ephemeral range {ephemeral}-{last} for {workers} test processes")
    start = low + worker * share
    first = pid % share
    for i in range(share):
        yield start + (first + i) % share


_PORTS = _own_ports()


def free_port() -> int:
    """A loopback port nothing listens on now, which no other test process
    picks and the kernel hands out to no ``bind(0)`` or connection
    (:func:`_own_ports`): for a process a test starts on it, or a worker
    that refuses connections.

    Raises:
        RuntimeError: every port of this process's share is taken.
    """
    for port in _PORTS:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use, or a connection of an earlier test lingers on it
        return port
    raise RuntimeError("no free port left in this test process's share")


def listening_socket(port: int = 0) -> socket.socket:
    """A listening loopback TCP socket (``port`` 0 = any free port)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


class Proc:
    """A server process on ``url``; :meth:`stop` ends it. Its ``TMPDIR`` is
    a folder of its own (:attr:`tmp`), so a test that looks at what a server
    left in the temporary folder never sees another test's or another
    suite's files. :attr:`live` holds every one started and not yet stopped
    (tests/leak_guard.py stops, and reports, what an owner left running).

    ``asgi-generate`` runs as a fork of a process that imported the package
    already (forked.py: a start costs no import), unless ``fork`` is False
    or its environment sets what an interpreter reads as it starts
    (:func:`forked.can_fork`); another ``module`` runs in a fresh interpreter."""

    live: set[Proc] = set()

    def __init__(self, name: str, args: list[str], sock: socket.socket, health: str, verify: str | None = None,
                 env: dict[str, str] | None = None, module: str = "asgi_generate", fork: bool = True) -> None:
        self.name = name
        self.port = sock.getsockname()[1]
        #: With ``verify`` (the CA file its certificate chains to) it serves HTTPS.
        self.verify = verify
        self.url = f"{'https' if verify else 'http'}://127.0.0.1:{self.port}"
        self.log_path = LOG_DIR / f"{name}-{self.port}.log"
        self._log = open(self.log_path, "wb")
        self.tmp = pathlib.Path(tempfile.mkdtemp(prefix=f"{name}-{self.port}-", suffix=".tmp", dir=LOG_DIR))
        env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1", "TMPDIR": str(self.tmp)}
        # ``{fd}`` in an argument: the listening socket's descriptor, else ``--fd`` passes it.
        if not any("{fd}" in a for a in args):
            args = [*args, "--fd", "{fd}"]
        if fork and module == "asgi_generate" and forked.can_fork(env):
            # A fork of a process that imported the package already (forked.py).
            self.proc = forked.Forked(args, sock=sock, log_path=str(self.log_path), env=env)
        else:
            fd = str(sock.fileno())
            self.proc = subprocess.Popen(
                [sys.executable, "-m", module, *(a.replace("{fd}", fd) for a in args)],
                pass_fds=[sock.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        Proc.live.add(self)
        sock.close()
        try:
            self.wait_ready(health)
        except BaseException:
            self.stop()
            raise

    def wait_ready(self, path: str, timeout: float = 50.0) -> None:
        """Poll ``path`` until it answers 200 (bounded by ``timeout``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}: {self.log()[-4000:]}")
            try:
                if httpx.get(self.url + path, timeout=1.0, verify=self.tls()).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} not ready after {timeout} s: {self.log()[-4000:]}")

    def tls(self) -> ssl.SSLContext | bool:
        """What httpx's ``verify`` takes to reach this process."""
        return ssl.create_default_context(cafile=self.verify) if self.verify else True

    def log(self) -> str:
        """Everything the process printed so far, from its first line: a
        line a test looks for may be anywhere in it (a busy test run's
        access lines come after a start-up line). The log is a file, so
        holding it costs no memory between looks."""
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the process."""
        self.proc.send_signal(sig)

    def stop(self) -> None:
        """Terminate (then kill after 10 s) and reap the process; killed
        at once if the wait is interrupted (a test's timeout)."""
        try:
            if self.proc.poll() is None:
                self.proc.terminate()
                self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10)
            Proc.live.discard(self)
            self._log.close()


def start_sim(
    protocol: str = "sglang",
    *,
    ttft_ms: float = 0,
    itl_ms: float = 0,
    incremental: bool = False,
    port: int = 0,
    extra: list[str] = (),
    verify: str | None = None,
    cold: bool = True,
) -> Proc:
    """Start a simulator process and wait for its ``/health`` (over HTTPS,
    checked against the CA file ``verify``, when given).

    ``cold`` (the default): no prefix cache (``--cache-tokens 0``), so a
    prompt sent twice, or aggregated and as P/D, answers the same value for
    value (``cached_tokens`` 0); ``cold=False``, or a ``--cache-tokens`` in
    ``extra``, keeps a cache as the engines do."""
    args = ["sim", "--protocol", protocol, "--ttft-ms", str(ttft_ms), "--itl-ms", str(itl_ms),
            *(["--cache-tokens", "0"] if cold else []), *extra]
    if incremental:
        args.append("--incremental-streaming-output")
    return Proc(f"sim-{protocol}", args, listening_socket(port), "/health", verify)


def start_frontend(
    workers: list[str], *, worker_class: str = "trio", extra: list[str] = (), health: str = "/health",
    verify: str | None = None, env: dict[str, str] | None = None, fork: bool = True,
) -> Proc:
    """Start ``asgi-generate serve`` in front of ``workers`` (``PROTOCOL=URL``);
    ``verify`` as for :func:`start_sim`; ``env`` added to its environment.
    ``fork=False``: a fresh interpreter started by this process, so it
    inherits this process's own state (its limits), as a run from a shell
    does; else a fork of the fork server (forked.py), as :class:`Proc`."""
    args = ["serve", "--worker-class", worker_class, "--health-interval", "0.2", "--log-level", "warning"]
    for w in workers:
        args += ["--worker", w]
    return Proc(f"frontend-{worker_class}", [*args, *extra], listening_socket(), health, verify, env, fork=fork)


def start_hypercorn(workers: list[str], *, worker_class: str = "trio", env: dict[str, str] | None = None) -> Proc:
    """Start ``hypercorn -k CLASS asgi_generate.server.asgi:app`` (a
    hypercorn you run yourself) in front of ``workers`` (``PROTOCOL=URL``),
    set by ``ASGI_GENERATE_*`` variables; ``env`` adds to them."""
    env = {"ASGI_GENERATE_WORKERS": ",".join(workers), "ASGI_GENERATE_HEALTH_INTERVAL": "0.2", **(env or {})}
    return Proc(f"hypercorn-{worker_class}", ["-k", worker_class, "-b", "fd://{fd}", "asgi_generate.server.asgi:app"],
                listening_socket(), "/health", env=env, module="hypercorn")


@contextlib.contextmanager
def held_fleet(worker_class: str, folder: pathlib.Path) -> Iterator[tuple[list[Proc], Proc, str]]:
    """A SGLang and a vLLM simulator (ITL 15 ms) behind one frontend of
    ``worker_class`` that holds streams across pauses
    (``--resume-after-pause``, hold timeout 10 s) and writes its trace to
    ``BASE.jsonl`` in ``folder``: ``(sims, frontend, BASE)``; all stopped
    at the end."""
    sims = [start_sim("sglang", itl_ms=15), start_sim("vllm", itl_ms=15)]
    base = str(folder / "t")
    fe = None
    try:
        fe = start_frontend([f"sglang={sims[0].url}", f"vllm={sims[1].url}"], worker_class=worker_class,
                            extra=["--resume-after-pause", "--trace-file", base + ".jsonl",
                                   "--pause-hold-timeout", "10"])
        yield sims, fe, base
    finally:
        if fe is not None:
            fe.stop()
        for s in sims:
            s.stop()


def stats(sim: Proc) -> dict:
    """The simulator's ``/sim/stats``."""
    return httpx.get(sim.url + "/sim/stats", timeout=5, verify=sim.tls()).json()


def generating(sim: Proc, running: int = 1, tokens: int = 1, timeout: float = 30.0) -> dict[str, int]:
    """Wait (bounded) until ``sim`` runs ``running`` requests, each with at
    least ``tokens`` output tokens generated (what a test means by "some
    tokens out", however slowly the machine goes); their counts by engine
    request id."""
    def ready():
        out = stats(sim)["running_output_tokens"]
        return len(out) == running and min(out.values()) >= tokens and out

    return wait_until(ready, timeout)


def reading_body(url: str, count: int = 1, timeout: float = 30.0) -> None:
    """Wait (bounded) until the frontend at ``url`` reads ``count`` request
    bodies (``/stats`` ``reading_body``): their heads were read and their
    bodies are not whole."""
    wait_until(lambda: httpx.get(url + "/stats", timeout=5).json()["reading_body"] == count, timeout)


JSON_HEADERS = {"content-type": "application/json"}


def post(url: str, body: dict | bytes, path: str = "/generate", **kw) -> httpx.Response:
    """POST a JSON object (or raw bytes) as ``application/json`` (unless
    ``headers`` says otherwise) and return the whole response."""
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    headers = {**JSON_HEADERS, **kw.pop("headers", {})}
    return httpx.post(url + path, content=content, headers=headers, timeout=kw.pop("timeout", 30), **kw)


def sse(url: str, body: dict, path: str = "/generate", **kw) -> tuple[int, list[bytes]]:
    """POST ``body`` as JSON and return the status and every SSE ``data`` payload."""
    headers = {**JSON_HEADERS, **kw.pop("headers", {})}
    with httpx.stream("POST", url + path, content=orjson.dumps(body), headers=headers, timeout=30, **kw) as resp:
        raw = b"".join(resp.iter_bytes())
        status = resp.status_code
    events = []
    for block in raw.split(b"\n\n"):
        data = [line[6:] for line in block.split(b"\n") if line.startswith(b"data: ")]
        if data:
            events.append(b"\n".join(data))
    return status, events


def stream_answer(protocol: str, chunks: list[bytes]) -> tuple[list[int], object]:
    """A stream's output ids and finish reason as its engine's format gives
    them (``chunks``: the SSE payloads, ``[DONE]`` skipped): SGLang's last
    chunk's ``output_ids`` and ``meta_info.finish_reason`` (an object, or
    ``None``), vLLM's choices' ``token_ids`` in order and their last
    ``finish_reason`` (a string, or ``None``)."""
    objs = [orjson.loads(c) for c in chunks if c != b"[DONE]"]
    if protocol == "sglang":
        return (objs[-1]["output_ids"], objs[-1]["meta_info"]["finish_reason"]) if objs else ([], None)
    ids: list[int] = []
    finish = None
    for o in objs:
        for ch in o.get("choices", []):
            ids += ch.get("token_ids") or []
            finish = ch.get("finish_reason") or finish
    return ids, finish


def finish_type(finish) -> str | None:
    """:func:`stream_answer`'s finish reason as one name: SGLang's ``type``, vLLM's string."""
    return finish.get("type") if isinstance(finish, dict) else finish


def start_streams(url: str, requests: list[tuple[str, dict]],
                  headers: dict | None = None) -> tuple[list[threading.Thread], list]:
    """Start one :func:`sse` per ``(path, body)`` in ``requests``, each in a
    thread (its own connection); ``out[i]`` is the i-th's answer once its
    thread ends (join them, bounded)."""
    out: list = [None] * len(requests)

    def one(i: int) -> None:
        path, body = requests[i]
        out[i] = sse(url, body, path, headers=headers or {})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    return threads, out


def same(a, b, where: str = "$") -> None:
    """Assert ``a == b`` value for value: dict keys in the same order,
    floats within two ULP."""
    if isinstance(a, float) or isinstance(b, float):
        assert isinstance(a, (int, float)) and isinstance(b, (int, float)), where
        assert abs(a - b) <= 2 * math.ulp(max(abs(a), abs(b))), f"{where}: {a} != {b}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for key in a:
            same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), f"{where}: {a} != {b}"
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def without_timing(obj):
    """``obj`` with SGLang's timing fields removed, for value comparison."""
    if isinstance(obj, dict):
        return {k: without_timing(v) for k, v in obj.items() if k != "e2e_latency"}
    if isinstance(obj, list):
        return [without_timing(v) for v in obj]
    return obj


class RawClient:
    """A blocking HTTP/1.1 client on a plain socket (h11), for tests that
    must hang up at an exact point or read slowly."""

    def __init__(self, url: str, rcvbuf: int | None = None) -> None:
        import h11

        self._h11 = h11
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(30)
        self.sock.connect((host, int(port)))
        self.conn = h11.Connection(h11.CLIENT)
        self.status: int | None = None
        self._buf = b""

    def send(self, body: bytes, *, upto: int | None = None, path: str = "/generate") -> None:
        """Send a POST with ``body``; with ``upto``, only that many body bytes."""
        h11 = self._h11
        head = h11.Request(method="POST", target=path, headers=[
            ("host", "127.0.0.1"), ("content-type", "application/json"), ("content-length", str(len(body)))])
        data = self.conn.send(head)
        if upto is None:
            data += self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage())
        else:
            data += body[:upto]
        self.sock.sendall(data)

    def _next(self):
        h11 = self._h11
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                self.conn.receive_data(self.sock.recv(65536))
                continue
            return event

    def events(self, count: int) -> list[bytes]:
        """Read until ``count`` more SSE ``data`` payloads arrived (or the end)."""
        h11 = self._h11
        out: list[bytes] = []
        while len(out) < count:
            while b"\n\n" in self._buf and len(out) < count:
                block, self._buf = self._buf.split(b"\n\n", 1)
                if block.startswith(b"data: "):
                    out.append(block[6:])
            if len(out) >= count:
                break
            event = self._next()
            if isinstance(event, h11.Response):
                self.status = event.status_code
            elif isinstance(event, h11.Data):
                self._buf += bytes(event.data)
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                break
        return out

    def close(self) -> None:
        """Hang up."""
        self.sock.close()


def trace_lines(pattern: str) -> list[bytes]:
    """The complete lines of the trace files matching the glob ``pattern``,
    file by file in name order. A line the trace writer is still writing
    (no newline yet: a batch larger than the file's buffer goes out in
    several writes) is left for the next look, so a test that polls never
    parses half a record."""
    lines: list[bytes] = []
    for f in sorted(glob.glob(pattern)):
        data = pathlib.Path(f).read_bytes()
        lines += data[: data.rfind(b"\n") + 1].splitlines()
    return lines


def trace_records(pattern: str) -> list[dict]:
    """The records of :func:`trace_lines`."""
    return [orjson.loads(line) for line in trace_lines(pattern)]


def children(pid: int) -> list[int]:
    """The live child processes of ``pid`` (from /proc)."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = pathlib.Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry))
    return kids


def tcp_states(port: int, peer_port: int) -> list[str]:
    """The kernel's TCP states (hex, ``01`` ESTABLISHED) of the IPv4 sockets
    on ``port`` connected to ``peer_port`` (``/proc/net/tcp``): empty once
    such a socket is gone."""
    states = []
    for line in pathlib.Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, remote, state = line.split()[1:4]
        if int(local.rsplit(":", 1)[1], 16) == port and int(remote.rsplit(":", 1)[1], 16) == peer_port:
            states.append(state)
    return states


async def asgi_request(app, method: str, path: str, body: bytes = b"", query: bytes = b"",
                       headers: list[tuple[bytes, bytes]] = ()) -> tuple[int, dict[bytes, bytes], bytes]:
    """One request to the ASGI ``app`` in process (no lifespan; a JSON
    content type, then ``headers``), within 5 s; its status, headers and body."""
    sent = [{"type": "http.request", "body": body, "more_body": False}]
    out: list[dict] = []

    async def receive() -> dict:
        if sent:
            return sent.pop()
        await anyio.sleep_forever()

    async def send(message: dict) -> None:
        out.append(message)

    scope = {"type": "http", "method": method, "path": path, "query_string": query, "root_path": "",
             "headers": [(b"content-type", b"application/json"), *headers]}
    with anyio.fail_after(5):
        await app(scope, receive, send)
    return out[0]["status"], dict(out[0]["headers"]), b"".join(m.get("body", b"") for m in out[1:])


async def asgi_json(app, method: str, path: str, body: dict | None = None) -> dict | None:
    """:func:`asgi_request` with a JSON object (or none); its JSON answer
    (``None`` for an empty body)."""
    _, _, raw = await asgi_request(app, method, path, orjson.dumps(body) if body is not None else b"")
    return orjson.loads(raw) if raw else None


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.02):
    """Poll ``predicate`` until it returns a truthy value (bounded: a bound
    no busy machine reaches; only a failing test waits it out)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)


class Traced:
    """A frontend started with ``--trace-file`` and ``args``: its records,
    one per request, taken in order."""

    def __init__(self, tmp_path_factory, args: list[str], worker_class: str = "trio") -> None:
        self.base = str(tmp_path_factory.mktemp("traced") / "trace")
        self.proc = start_frontend([], worker_class=worker_class, extra=["--trace-file", self.base + ".jsonl", *args])
        self.url = self.proc.url
        self.taken = 0

    def records(self) -> list[dict]:
        return trace_records(f"{self.base}.*.jsonl")

    def take(self, n: int = 1, timeout: float = 10.0) -> list[dict]:
        """The next ``n`` records, once written within ``timeout`` seconds
        (exactly ``n`` new ones); a timeout names the requests still
        missing (by ``public_id``)."""
        try:
            recs = wait_until(lambda: (r := self.records()) and len(r) >= self.taken + n and r, timeout)
        except AssertionError:
            have = sorted(str(r.get("public_id")) for r in self.records()[self.taken:])
            raise AssertionError(f"{len(have)} of {n} records within {timeout} s; written: {have}") from None
        assert len(recs) == self.taken + n, "one record per request"
        new = recs[self.taken:]
        self.taken += n
        return new

    def stop(self) -> None:
        self.proc.stop()


def vnorm(obj):
    """A vLLM answer or chunk without what differs between any two runs
    (the request id, ``created``)."""
    if isinstance(obj, dict):
        return {k: vnorm(v) for k, v in obj.items() if k not in ("request_id", "created")}
    if isinstance(obj, list):
        return [vnorm(v) for v in obj]
    return obj


async def read_h11_request(stream, conn):
    """A fake worker's read of one request on ``conn`` (an ``h11.Connection``
    over the anyio ``stream``): ``(h11.Request, body bytes)``, or
    ``(None, b"")`` when the frontend closed the connection."""
    request, parts = None, []
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            try:
                conn.receive_data(await stream.receive())
            except anyio.EndOfStream:
                conn.receive_data(b"")
        elif isinstance(event, h11.Request):
            request = event
        elif isinstance(event, h11.Data):
            parts.append(event.data)
        elif isinstance(event, h11.EndOfMessage):
            return request, b"".join(parts)
        else:  # ConnectionClosed
            return None, b""


async def send_h11_answer(stream, conn, body: bytes, status: int = 200, headers=()) -> None:
    """A fake worker's whole answer in one write: ``status``, a
    ``content-length``, the extra ``headers`` ((name, value) pairs), ``body``."""
    head = h11.Response(status_code=status, headers=[("content-length", str(len(body))), *headers])
    await stream.send(conn.send(head) + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))


# -- P/D simulators ---------------------------------------------------------------

#: ``sim`` flags of an SGLang prefill worker (its bootstrap server on a free port).
PREFILL = ["--disaggregation-mode", "prefill", "--bootstrap-port", "0"]
#: ``sim`` flags of an SGLang decode worker.
DECODE = ["--disaggregation-mode", "decode"]
#: ``sim`` flag: vLLM's routed experts in every answer (checked across the pair).
EXPERTS = "--enable-return-routed-experts"
#: ``sim`` flags of a vLLM prefill (KV producer) and decode (KV consumer) worker.
PRODUCER = ["--kv-role", "producer", EXPERTS]
CONSUMER = ["--kv-role", "consumer", EXPERTS]


def prefill_spec(sim) -> str:
    """The ``--prefill`` worker spec of SGLang prefill simulator ``sim``,
    with the bootstrap port it reports."""
    port = httpx.get(sim.url + "/get_server_info", timeout=5).json()["disaggregation_bootstrap_port"]
    return f"sglang={sim.url}?bootstrap_port={port}"


# -- raw SSE clients ----------------------------------------------------------------

_EVENT = re.compile(rb"data: (.*?)\n\n", re.DOTALL)


def tokens_in(raw: bytes) -> int:
    """Tokens in the complete SGLang SSE events of ``raw`` (cumulative chunks)."""
    best = 0
    for payload in _EVENT.findall(raw):
        if payload != b"[DONE]":
            best = max(best, len(orjson.loads(payload).get("output_ids", [])))
    return best


def raw_request(url: str, payload: bytes, headers: dict) -> socket.socket:
    """Send a POST /generate on a plain socket (no reading); return it."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    head = (f"POST /generate HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n{extra}"
            f"content-length: {len(payload)}\r\n\r\n").encode()
    sock.sendall(head + payload)
    return sock


def sse_then_hang_up(url: str, payload: bytes, headers: dict, k: int) -> int:
    """Read until ``k`` SSE events arrived (or the answer ended), hang up,
    and return the tokens received."""
    sock = raw_request(url, payload, headers)
    raw = b""
    try:
        while k and len(_EVENT.findall(raw)) < k and b"[DONE]" not in raw:
            if raw.startswith(b"HTTP/1.1 ") and not raw.startswith(b"HTTP/1.1 200") and b"\r\n\r\n" in raw:
                break
            data = sock.recv(65536)
            if not data:
                break
            raw += data
        # Hang up our side, then read what the server had already sent
        # until it closes: what was sent is what was received.
        sock.shutdown(socket.SHUT_WR)
        while data := sock.recv(65536):
            raw += data
    finally:
        sock.close()
    return tokens_in(raw)
