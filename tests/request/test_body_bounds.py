"""Request bodies are bounded: a global budget of bytes read and decoded at
once (503 with ``Retry-After`` past a bounded wait), a body-read deadline
(408), the cap checked before the first ``receive()`` (413 with
``Connection: close``, also under ``Expect: 100-continue``), and prompts
longer than the worker's context refused with the engine's own 400 before
any engine sees them.

The memory goal itself (50 bodies of 30 MiB) is measured by
``bench/bench_bodies.py``; here a few bodies at once show the budget's
accounting holding them to its capacity.
"""

from __future__ import annotations

import socket
import time

import anyio
import h11
import httpx
import orjson
import pytest

from asgi_generate.request.budget import BodyBudget
from asgi_generate.exceptions import BodyTimeout, ClientDisconnected
from asgi_generate.request.framing import read_body
from asgi_generate.server.hypercorn.lean import AppQueue, TrioAppQueue
from asgi_generate.protocols import PROTOCOLS, read_model_card

SGLANG, VLLM = PROTOCOLS["sglang"], PROTOCOLS["vllm"]
from support import post, sse, start_frontend, start_sim, stats, trace_records

MiB = 1024 * 1024
MAX_BODY = 4 * MiB
BUDGET = 6 * MiB
# The deadlines the 408 and 503 tests wait out (the ``impatient`` frontend):
# the 503 test's holder reads for as long as the late one waits, and a few
# seconds more (the test's own polls).
READ_TIMEOUT = 6.0
BUDGET_WAIT = 3.0
# The ``bounded`` frontend's: longer than anything takes on a loaded machine,
# so a body waits its turn and is read however slowly the machine goes; a
# test's own timeout bounds them.
PATIENT = 120.0
CONTEXT = 32768  # the simulators' context length
VLLM_PATH = "/inference/v1/generate"


# -- unit: the budget and the body reader ------------------------------------


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


@pytest.mark.anyio
async def test_budget_grants_in_arrival_order_and_never_beyond_capacity():
    budget = BodyBudget(100)
    first = await budget.reserve(60, 1.0)
    assert (first.nbytes, budget.in_use) == (60, 60)
    order: list[str] = []

    async def take(name: str, n: int) -> None:
        lease = await budget.reserve(n, 5.0)
        order.append(name)
        assert budget.in_use <= budget.capacity
        await anyio.sleep(0.01)
        lease.release()

    async with anyio.create_task_group() as tg:
        tg.start_soon(take, "big", 90)
        await anyio.sleep(0.01)
        tg.start_soon(take, "small", 20)  # would fit now, but waits behind "big"
        await anyio.sleep(0.01)
        assert (budget.waiting, budget.in_use) == (2, 60)
        first.release()
        first.release()  # idempotent
    assert order == ["big", "small"]
    assert (budget.in_use, budget.waiting) == (0, 0)


@pytest.mark.anyio
async def test_budget_wait_is_bounded_and_leaves_nothing_held():
    budget = BodyBudget(100)
    held = await budget.reserve(500, 1.0)  # clamped to the capacity
    assert held.nbytes == 100
    t0 = anyio.current_time()
    assert await budget.reserve(1, 0.2) is None
    assert anyio.current_time() - t0 >= 0.2
    assert (budget.in_use, budget.waiting) == (100, 0)
    with anyio.move_on_after(0.05):  # cancelled from outside while waiting
        await budget.reserve(1, 5.0)
    assert (budget.in_use, budget.waiting) == (100, 0)
    held.release()
    assert budget.in_use == 0


@pytest.mark.anyio
async def test_read_body_gives_up_at_the_deadline():
    async def stalled():
        if not sent:
            sent.append(1)
            return {"type": "http.request", "body": b"{", "more_body": True}
        await anyio.sleep_forever()

    sent: list[int] = []
    t0 = anyio.current_time()
    with pytest.raises(BodyTimeout), anyio.fail_after(30):
        await read_body(stalled, 100, 10, timeout=0.2)
    assert anyio.current_time() - t0 >= 0.2


@pytest.mark.anyio
async def test_a_body_queued_whole_is_taken_with_no_deadline_to_keep(monkeypatch, anyio_backend):
    queue = AppQueue(0) if anyio_backend == "asyncio" else TrioAppQueue(0)
    await queue.put({"type": "http.request", "body": b"{}", "more_body": False})

    def no_scope(_timeout):
        raise AssertionError("a deadline scope for a body that was all there")

    monkeypatch.setattr(anyio, "move_on_after", no_scope)
    assert await read_body(queue.get, 100, 2, timeout=0.2, receive_nowait=queue.get_nowait) == b"{}"
    assert queue.get_nowait() is None
    # hypercorn's shape: the body's bytes, then an empty last message
    await queue.put({"type": "http.request", "body": b"[1]", "more_body": True})
    await queue.put({"type": "http.request", "body": b"", "more_body": False})
    assert await read_body(queue.get, 100, 3, timeout=0.2, receive_nowait=queue.get_nowait) == b"[1]"
    assert queue.get_nowait() is None


@pytest.mark.anyio
async def test_a_body_partly_queued_is_read_on_under_the_deadline(anyio_backend):
    queue = AppQueue(0) if anyio_backend == "asyncio" else TrioAppQueue(0)
    await queue.put({"type": "http.request", "body": b"[1,", "more_body": True})
    t0 = anyio.current_time()
    with pytest.raises(BodyTimeout), anyio.fail_after(30):
        await read_body(queue.get, 100, 5, timeout=0.2, receive_nowait=queue.get_nowait)
    assert anyio.current_time() - t0 >= 0.2
    await queue.put({"type": "http.request", "body": b"[1,", "more_body": True})
    await queue.put({"type": "http.request", "body": b"2]", "more_body": False})
    assert await read_body(queue.get, 100, 5, timeout=5.0, receive_nowait=queue.get_nowait) == b"[1,2]"
    await queue.put({"type": "http.disconnect"})
    with pytest.raises(ClientDisconnected):
        await read_body(queue.get, 100, 5, timeout=5.0, receive_nowait=queue.get_nowait)
    assert queue.get_nowait() is None


def test_server_info_gives_the_context_length_under_one_key():
    # SGLang's /get_server_info has context_length null unless the server ran
    # --context-length; /v1/models always carries model_config.context_len.
    assert SGLANG.read_info({"context_length": None, "model_path": "m"})["max_model_len"] is None
    assert SGLANG.read_info({"context_length": 4096})["max_model_len"] == 4096
    card = {"object": "list", "data": [{"id": "m", "max_model_len": 8192, "root": "/models/m"}]}
    assert read_model_card(card) == {"served_model_name": "m", "max_model_len": 8192, "root": "/models/m"}
    assert VLLM.read_info(card) == {"served_model_name": "m", "max_model_len": 8192, "root": "/models/m"}
    assert SGLANG.models_path == b"/v1/models" and VLLM.models_path is None


# -- serving ------------------------------------------------------------------


@pytest.fixture(scope="module")
def body_sims():
    procs = {"sglang": start_sim("sglang"), "vllm": start_sim("vllm")}
    yield procs
    for p in procs.values():
        p.stop()


def _bounded_frontend(body_sims, tmp_path_factory, worker_class: str, budget_wait: float, read_timeout: float):
    """A frontend with a small cap and budget and the given body deadlines,
    tracing to ``proc.trace_base``."""
    base = tmp_path_factory.mktemp("bounds") / "trace"
    proc = start_frontend(
        [f"sglang={body_sims['sglang'].url}", f"vllm={body_sims['vllm'].url}"],
        worker_class=worker_class,
        extra=[
            "--max-body-bytes", str(MAX_BODY),
            "--body-budget-bytes", str(BUDGET),
            "--body-budget-wait", str(budget_wait),
            "--body-read-timeout", str(read_timeout),
            "--trace-file", f"{base}.jsonl",
        ],
    )
    proc.trace_base = base
    return proc


@pytest.fixture(scope="module", params=["trio", "asyncio"])
def bounded(request, body_sims, tmp_path_factory):
    """The small cap and budget, with body deadlines no machine runs into."""
    proc = _bounded_frontend(body_sims, tmp_path_factory, request.param, PATIENT, PATIENT)
    yield proc
    proc.stop()


@pytest.fixture(scope="module", params=["trio", "asyncio"])
def impatient(request, body_sims, tmp_path_factory):
    """The small cap and budget, with the short body deadlines the 408 and
    503 tests wait out."""
    proc = _bounded_frontend(body_sims, tmp_path_factory, request.param, BUDGET_WAIT, READ_TIMEOUT)
    yield proc
    proc.stop()


def fe_stats(fe) -> dict:
    return httpx.get(fe.url + "/stats", timeout=5).json()


def records(fe) -> list[dict]:
    return trace_records(str(fe.trace_base.parent / "trace.*.jsonl"))


def settled_records(fe) -> int:
    """How many records there are once every finished request's record is
    written (the writer lags behind the answers)."""
    deadline = time.monotonic() + 30
    while (n := len(records(fe))) != fe_stats(fe)["request_items"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return n


def new_records(fe, seen: int, n: int) -> list[dict]:
    """The ``n`` records written after the first ``seen`` (waits, bounded)."""
    deadline = time.monotonic() + 30
    while len(recs := records(fe)) < seen + n:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert len(recs) == seen + n
    return recs[seen:]


def new_record(fe, seen: int) -> dict:
    return new_records(fe, seen, 1)[0]


def wait_idle(fe) -> dict:
    """Poll /stats (bounded) until no body is read or waits; return them."""
    deadline = time.monotonic() + 30
    while True:
        s = fe_stats(fe)
        if (s["reading_body"], s["body_budget"]["in_use_bytes"], s["body_budget"]["waiting"]) == (0, 0, 0):
            return s
        assert time.monotonic() < deadline, s
        time.sleep(0.02)


def wait_stats(fe, check) -> dict:
    deadline = time.monotonic() + 30
    while True:
        s = fe_stats(fe)
        if check(s):
            return s
        assert time.monotonic() < deadline, s
        time.sleep(0.02)


class Upload:
    """A raw HTTP/1.1 upload whose body goes out in pieces (h11 parses the
    answer)."""

    def __init__(self, fe, path: str, length: int, expect: bool = False) -> None:
        self.sock = socket.create_connection(("127.0.0.1", fe.port), timeout=30)
        self.conn = h11.Connection(h11.CLIENT)
        headers = [("host", "x"), ("content-type", "application/json"), ("content-length", str(length))]
        if expect:
            headers.append(("expect", "100-continue"))
        self.sock.sendall(self.conn.send(h11.Request(method="POST", target=path, headers=headers)))

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def interim(self) -> int:
        """Wait, as curl does, for the first answer to a head sent with
        ``Expect: 100-continue``; return its status (100 to go on)."""
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                self.conn.receive_data(self.sock.recv(65536))
            elif isinstance(event, (h11.InformationalResponse, h11.Response)):
                if isinstance(event, h11.Response):  # leave it for response()
                    raise AssertionError(f"final answer {event.status_code} instead of 100 Continue")
                return event.status_code

    def response(self) -> tuple[list[int], int, dict, bytes, bool]:
        """Informational statuses, status, headers, body, and whether the
        server closed the connection after it (looked at only when the
        answer says ``connection: close``)."""
        informational, status, headers, body = [], None, {}, b""
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                self.conn.receive_data(self.sock.recv(65536))
            elif isinstance(event, h11.InformationalResponse):
                informational.append(event.status_code)
            elif isinstance(event, h11.Response):
                status, headers = event.status_code, {k.decode(): v.decode() for k, v in event.headers}
            elif isinstance(event, h11.Data):
                body += bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                break
        if headers.get("connection") != "close":
            return informational, status, headers, body, False
        self.sock.settimeout(5)
        try:
            closed = self.sock.recv(1) == b""
        except (TimeoutError, ConnectionResetError):
            closed = False
        return informational, status, headers, body, closed

    def close(self) -> None:
        self.sock.close()


@pytest.mark.e2e
def test_stalled_body_gets_408_at_the_deadline_and_is_seen_while_it_waits(impatient):
    wait_idle(impatient)
    seen = settled_records(impatient)
    before = fe_stats(impatient)["by_status"].get("rejected", 0)
    t0 = time.monotonic()  # before the head: the server's deadline starts after it
    up = Upload(impatient, "/generate", 1000)
    up.send(b'{"input_ids": [1, 2')
    try:
        s = wait_stats(impatient, lambda s: s["reading_body"] == 1)
        assert s["body_budget"]["in_use_bytes"] == 1000
        _, status, headers, body, closed = up.response()
        waited = time.monotonic() - t0
    finally:
        up.close()
    assert status == 408 and headers["connection"] == "close" and closed
    assert orjson.loads(body) == {
        "object": "error", "message": f"request body not received within {READ_TIMEOUT:g} s",
        "type": "Request Timeout", "param": None, "code": 408,
    }
    assert waited >= READ_TIMEOUT - 0.5  # it waited out the deadline (a loaded machine only adds to it)
    s = wait_idle(impatient)
    assert s["by_status"]["rejected"] == before + 1
    rec = new_record(impatient, seen)
    assert (rec["status"], rec["http_status"], rec["error"]) == (
        "rejected", 408, {"type": "body_timeout", "message": f"request body not received within {READ_TIMEOUT:g} s"})
    assert rec["replay"] == {"excluded": "not_decoded"}


@pytest.mark.e2e
@pytest.mark.parametrize("path", ["/generate", VLLM_PATH])
def test_declared_length_over_the_cap_gets_413_and_close_without_reading(bounded, path):
    # hypercorn 0.18 would answer `100 Continue` itself as soon as it has
    # parsed the head (H11Protocol._handle_events); hypercorn_fixes sends it
    # on the app's first receive(), which a refusal on the headers never makes.
    wait_idle(bounded)
    seen = settled_records(bounded)
    up = Upload(bounded, path, 41943040, expect=True)
    try:
        informational, status, headers, body, closed = up.response()
    finally:
        up.close()
    assert informational == []
    assert (status, headers["connection"], closed) == (413, "close", True)
    message = f"request body exceeds the limit of {MAX_BODY} bytes"
    if path == "/generate":
        assert orjson.loads(body) == {
            "object": "error", "message": message, "type": "Request Entity Too Large", "param": None, "code": 413}
    else:
        assert orjson.loads(body)["error"]["message"] == message
    rec = new_record(bounded, seen)
    assert (rec["status"], rec["http_status"], rec["error"]) == (
        "rejected", 413, {"type": "too_large", "message": message})


@pytest.mark.e2e
def test_small_body_with_expect_continue_is_served(bounded, body_sims):
    wait_idle(bounded)
    payload = orjson.dumps({"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3}})
    up = Upload(bounded, "/generate", len(payload), expect=True)
    try:
        assert up.interim() == 100  # the body is only sent once asked for
        up.send(payload)
        informational, status, _, body, _ = up.response()
    finally:
        up.close()
    direct = post(body_sims["sglang"].url, payload)
    assert status == 200 and informational == []
    assert orjson.loads(body)["output_ids"] == direct.json()["output_ids"]
    assert len(direct.json()["output_ids"]) == 3


@pytest.mark.e2e
def test_beyond_the_budget_waits_then_gets_503_with_retry_after_unread(impatient):
    wait_idle(impatient)
    seen = settled_records(impatient)
    before = fe_stats(impatient)["by_status"].get("unavailable", 0)
    holder = Upload(impatient, "/generate", MAX_BODY)  # holds 4 of the 6 MiB
    holder.send(b'{"input_ids": [')
    wait_stats(impatient, lambda s: s["body_budget"]["in_use_bytes"] == MAX_BODY)
    t0 = time.monotonic()  # before the head: the server's wait starts after it
    late = Upload(impatient, "/generate", MAX_BODY)
    try:
        s = wait_stats(impatient, lambda s: s["body_budget"]["waiting"] == 1)
        assert (s["reading_body"], s["body_budget"]["in_use_bytes"]) == (1, MAX_BODY)
        # A small body would fit beside the holder, but the budget is first
        # come, first served: it queues behind the late one and is served
        # once that one gives up. Sent half the wait later, so that its own
        # wait ends that long after the late one's: only a stall of the
        # server's loop as long (1.5 s) could end both waits at once. The
        # sleep spaces two deadlines; it waits for nothing to happen.
        time.sleep(BUDGET_WAIT / 2)
        ok = post(impatient.url, {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}})
        assert (ok.status_code, len(ok.json().get("output_ids", ()))) == (200, 2), ok.text
        _, status, headers, body, closed = late.response()
        waited = time.monotonic() - t0
    finally:
        late.close()
        holder.close()
    assert (status, headers.get("retry-after"), headers.get("connection"), closed) == (503, "1", "close", True), body
    assert orjson.loads(body) == {
        "object": "error", "message": "too many request bodies in flight; retry later",
        "type": "503", "param": None, "code": 503,
    }
    assert waited >= BUDGET_WAIT - 0.5  # it waited out the budget's wait
    s = wait_idle(impatient)
    assert s["by_status"]["unavailable"] == before + 1
    by_status = {r["status"]: r for r in new_records(impatient, seen, 3)}
    assert sorted(by_status) == ["client_disconnect", "ok", "unavailable"]  # holder, small one, late one
    assert (by_status["unavailable"]["http_status"], by_status["unavailable"]["error"]) == (
        503, {"type": "busy", "message": "too many request bodies in flight; retry later"})


@pytest.mark.e2e
def test_large_bodies_at_once_stay_within_the_budget_and_get_the_engines_400(bounded, body_sims):
    """Six 2.4 MiB over-long vLLM prompts at once: two fit the 6 MiB budget,
    the others wait their turn (not 503: the wait for a turn is longer than
    any machine takes to read and refuse the bodies ahead), and all get
    vLLM's 400, decoded off the event loop, none reaching the engine."""
    sim = body_sims["vllm"]
    wait_idle(bounded)
    arrived = stats(sim)["generate_requests"]
    n_ids = 1_250_000
    payload = orjson.dumps({"token_ids": [7] * n_ids, "sampling_params": {"max_tokens": 1}})
    assert MiB < len(payload) < MAX_BODY
    ups = [Upload(bounded, VLLM_PATH, len(payload)) for _ in range(6)]
    try:
        for up in ups:
            up.send(payload[:10])
        s = wait_stats(bounded, lambda s: s["body_budget"]["waiting"] == 4)
        assert s["body_budget"]["in_use_bytes"] == 2 * len(payload) <= BUDGET
        assert s["reading_body"] == 2
        for up in ups:
            up.send(payload[10:])
        answers = [up.response() for up in ups]
    finally:
        for up in ups:
            up.close()
    message = (
        f"The decoder prompt (length {n_ids}) is longer than the maximum model length of {CONTEXT}. "
        "Make sure that `max_model_len` is no smaller than the number of text tokens."
    )
    expected = {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}}
    assert [(a[1], orjson.loads(a[3])) for a in answers] == [(400, expected)] * 6
    assert stats(sim)["generate_requests"] == arrived
    wait_idle(bounded)


@pytest.mark.e2e
@pytest.mark.parametrize("n", [CONTEXT, CONTEXT + 1])
def test_sglang_prompt_over_the_context_gets_sglangs_400_without_reaching_it(bounded, body_sims, n):
    sim = body_sims["sglang"]
    body = {"input_ids": [5] * n, "sampling_params": {"max_new_tokens": 1}}
    arrived = stats(sim)["generate_requests"]
    seen = settled_records(bounded)
    resp = post(bounded.url, body)
    assert stats(sim)["generate_requests"] == arrived
    message = f"The input ({n} tokens) is longer than the model's context length ({CONTEXT} tokens)."
    assert (resp.status_code, resp.json()) == (400, {"error": {"message": message}})
    rec = new_record(bounded, seen)
    assert (rec["status"], rec["http_status"], rec["input_tokens"], rec["replay"], rec["attempts"]) == (
        "rejected", 400, n, {"excluded": "rejected"}, [])
    assert rec["error"]["message"] == message
    direct = post(sim.url, body)  # the simulator refuses it the same way
    assert (direct.status_code, direct.json()) == (400, resp.json())
    fits = post(bounded.url, {"input_ids": [5] * (CONTEXT - 2), "sampling_params": {"max_new_tokens": 1}})
    assert fits.status_code == 200 and len(fits.json()["output_ids"]) == 1
    assert stats(sim)["generate_requests"] == arrived + 2  # the direct one and the fitting one


@pytest.mark.e2e
def test_sglang_streamed_prompt_over_the_context_is_refused_in_band_as_sglang_does(bounded, body_sims):
    sim = body_sims["sglang"]
    body = {"input_ids": [5] * (CONTEXT + 3), "stream": True, "sampling_params": {"max_new_tokens": 1}}
    arrived = stats(sim)["generate_requests"]
    status, events = sse(bounded.url, body)
    assert stats(sim)["generate_requests"] == arrived
    message = f"The input ({CONTEXT + 3} tokens) is longer than the model's context length ({CONTEXT} tokens)."
    assert (status, [orjson.loads(e) for e in events[:-1]], events[-1]) == (
        200, [{"error": {"message": message}}], b"[DONE]")
    assert sse(sim.url, body) == (status, events)  # the simulator answers the same


@pytest.mark.e2e
@pytest.mark.parametrize("n", [CONTEXT, CONTEXT + 1])
def test_vllm_prompt_over_the_context_gets_vllms_400_without_reaching_it(bounded, body_sims, n):
    sim = body_sims["vllm"]
    body = {"token_ids": [5] * n, "sampling_params": {"max_tokens": 1}}
    arrived = stats(sim)["generate_requests"]
    resp = post(bounded.url, body, path=VLLM_PATH)
    assert stats(sim)["generate_requests"] == arrived
    if n > CONTEXT:
        message = (f"The decoder prompt (length {n}) is longer than the maximum model length of {CONTEXT}. "
                   "Make sure that `max_model_len` is no smaller than the number of text tokens.")
    else:
        message = (f"The decoder prompt (length {n}) plus the number of requested output tokens (at least 1) "
                   f"is longer than the maximum model length of {CONTEXT}. Make sure that `max_model_len` is "
                   "no smaller than the number of text tokens (prompt + requested output tokens).")
    assert (resp.status_code, resp.json()) == (
        400, {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}})
    direct = post(sim.url, body, path=VLLM_PATH)
    assert (direct.status_code, direct.json()) == (400, resp.json())
    assert stats(sim)["generate_requests"] == arrived + 1  # the direct one


@pytest.mark.e2e
def test_models_route_shows_each_workers_context_length(bounded):
    workers = httpx.get(bounded.url + "/v1/models", timeout=5).json()["workers"]
    assert [(w["protocol"], w["max_model_len"]) for w in workers] == [("sglang", CONTEXT), ("vllm", CONTEXT)]
