"""The leg runner and the handshakes, in process: workers are fake
connection pools that answer from a script (no socket, no subprocess), so
every worker body sent, every classification and every client byte is exact.
"""

from __future__ import annotations

import itertools

import anyio
import orjson
import pytest

from asgi_generate.config import Settings
from asgi_generate.request import handshakes
from asgi_generate.tracing.state import RequestState
from asgi_generate.request.handshakes import AGGREGATED, CONCURRENT_PAIR, PAIRS, SEQUENTIAL_PAIR, handshake
from asgi_generate.request.legs import Leg, LegEnd
from asgi_generate.sdk import _ids as ids
from asgi_generate.tracing.state import LegRecord
from asgi_generate.exceptions import ConnectFailed, TimedOut, WorkerDisconnected
from asgi_generate.protocols import PROTOCOLS
from asgi_generate.workers.router import Worker
from asgi_generate_sglang import SGLangCodec
from asgi_generate_vllm import VLLMCodec
from fakes import STALL, FakeContext, FakePool, FakeResponse, FakeRouter
from test_context import generation


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


def worker(wid: str, protocol: str, pool: FakePool, role: str = "aggregated", url: str = "http://127.0.0.1:1") -> Worker:
    w = Worker(wid, PROTOCOLS[protocol], url, pool, pool, role, 8998 if role == "prefill" else None)
    w.healthy = True
    return w


def sse(*objs) -> bytes:
    return b"".join(b"data: " + (o if type(o) is bytes else orjson.dumps(o)) + b"\n\n" for o in objs)


@pytest.fixture
def minted(monkeypatch):
    """Engine ids e0..., and every bootstrap room 7."""
    counter = itertools.count()
    monkeypatch.setattr(ids, "mint", lambda: f"e{next(counter)}")
    monkeypatch.setattr(handshakes.secrets, "randbits", lambda bits: 7)


class Client:
    """A generation for ``body`` on ``codec`` over ``router``; ``messages``
    are its ASGI sends, ``aborts`` the engine aborts it asked for."""

    def __init__(self, codec, body: dict, router: FakeRouter, **settings) -> None:
        self.messages: list[dict] = []
        self.ctx = FakeContext(router, **settings)
        self.aborts = self.ctx.aborted
        headers = {b"content-type": b"application/json"}
        req = codec.decode(orjson.dumps(body), headers)
        self.st = RequestState("r" * 32, codec.name, "/generate", "POST")
        self.st.headers = headers
        self.gen = generation(self.ctx, codec, req, self.st, self.send)

    async def send(self, message: dict) -> None:
        self.messages.append(message)

    async def run(self) -> None:
        await self.gen.run()
        await self.gen.abort_live_legs()  # as the handler's finally does

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages)

    @property
    def status(self) -> int:
        return self.messages[0]["status"]

    def attempts(self) -> list[tuple]:
        return [(a.engine_id, a.role, a.worker_id, a.outcome, a.live) for a in self.st.attempts]


# -- the leg runner ---------------------------------------------------------------


class Reader:
    """A leg reader over a codec's state of a request: records the events delivered to it."""

    outbox: list = []
    leg = None

    def __init__(self, ex) -> None:
        self.ex = ex
        self.events = []

    def answered(self, attempt):
        return not attempt.live

    def read_payload(self, attempt, payload):
        return self.ex.feed(attempt, payload) if attempt.live else None

    async def deliver_event(self, attempt, event):
        self.events.append((event.token_ids, event.finish_reason))
        if event.finish_reason is not None:
            attempt.live = False
            attempt.outcome = "finished"

    async def flush(self):
        pass

    async def cut_short(self, attempt):
        raise WorkerDisconnected("worker ended the response without a finish reason")


CHUNK = {"text": "a", "output_ids": [5], "meta_info": {"id": "e0", "finish_reason": None}}
LAST = {"text": "ab", "output_ids": [5, 6], "meta_info": {"id": "e0", "finish_reason": {"type": "length", "length": 2}}}
BROKEN = WorkerDisconnected("worker closed the connection mid-response")

# (the worker's answer, made afresh; probe says up) -> (end, live, outcome, detail, marked down, probed, events)
RUNS = {
    "finished": (lambda: FakeResponse(200, [sse(CHUNK), sse(LAST, b"[DONE]")]), True,
                 LegEnd.FINISHED, False, "finished", None, [], [], [([5], None), ([6], "length")]),
    "error_answer": (lambda: FakeResponse(503, [b'{"error": "shutting down"}']), True,
             LegEnd.ERROR_ANSWER, False, "error", (503, b'{"error": "shutting down"}', None), [], [], []),
    "connect_failed": (lambda: ConnectFailed("connection refused"), True,
                       LegEnd.CONNECT_FAILED, False, "connect_failed", None, [("w0", "connection refused")], [], []),
    "headers_timeout": (lambda: TimedOut("deadline"), True,
                        LegEnd.TIMED_OUT, True, None, "worker w0 sent no response headers within 60 s", [], [], []),
    "first_token_timeout": (lambda: FakeResponse(200, [TimedOut("deadline")]), True,
                            LegEnd.TIMED_OUT, True, None, "worker w0 sent no token within 1800 s", [], [], []),
    "inter_token_timeout": (lambda: FakeResponse(200, [sse(CHUNK), b": ping\n\n", TimedOut("deadline")]), True,
                            LegEnd.TIMED_OUT, True, None, "worker w0 sent no token for 300 s", [], [], [([5], None)]),
    "engine_error": (lambda: FakeResponse(200, [sse(CHUNK), BROKEN]), True,
                     LegEnd.ENGINE_ERROR, True, "error",
                     "worker w0 broke the connection mid-answer: worker closed the connection mid-response",
                     [], ["w0"], [([5], None)]),
    "worker_lost": (lambda: FakeResponse(200, [sse(CHUNK), BROKEN]), False,
                    LegEnd.WORKER_LOST, True, "worker_lost", "worker closed the connection mid-response",
                    [], ["w0"], [([5], None)]),
    "ended_unfinished": (lambda: FakeResponse(200, [sse(CHUNK)]), True,
                         LegEnd.ENGINE_ERROR, True, "error",
                         "worker w0 broke the connection mid-answer: worker ended the response without a finish reason",
                         [], ["w0"], [([5], None)]),
    "protocol_error": (lambda: FakeResponse(200, [sse(b"{not json")]), True,
                       LegEnd.PROTOCOL_ERROR, True, "error", "worker answer: the chunk is not JSON", [], [], []),
    "drain_after_finish": (lambda: FakeResponse(200, [sse(LAST), BROKEN]), False,
                           LegEnd.FINISHED, False, "finished", None, [], [], [([5, 6], "length")]),
}


@pytest.mark.anyio
@pytest.mark.parametrize("case", list(RUNS))
async def test_leg_runner_classifies_how_a_leg_ended(case):
    answer, up, end, live, outcome, detail, marked, probed, events = RUNS[case]
    w = worker("w0", "sglang", FakePool(answer()))
    router = FakeRouter(probe_up=up)
    codec = SGLangCodec()
    ex = codec.exchange(codec.decode(b'{"input_ids": [1, 2], "stream": true, "rid": "mine"}', {}), "r" * 32)
    attempt = LegRecord("e0", "aggregated", "w0", {}, worker=w)
    reader = Reader(ex)
    st = RequestState("r" * 32, "sglang", "/generate", "POST")
    leg = Leg(st, Settings(), w, attempt, ex.worker_request(attempt), 300.0)
    assert (await leg.run(reader, router)) is end
    assert (attempt.live, attempt.outcome) == (live, outcome)
    got = {LegEnd.ERROR_ANSWER: leg.error_answer, LegEnd.WORKER_LOST: leg.lost, LegEnd.CANCELLED: leg.lost}.get(
        end, None if leg.error is None else leg.error.message)
    assert got == detail
    assert (router.marked, router.probed, reader.events) == (marked, probed, events)
    assert w.inflight == set() and reader.leg is None and st.t_dispatched is not None


@pytest.mark.anyio
async def test_leg_runner_cancels_a_leg_whose_worker_the_probe_gave_up():
    w = worker("w0", "sglang", FakePool(FakeResponse(200, [sse(CHUNK), STALL])))
    codec = SGLangCodec()
    ex = codec.exchange(codec.decode(b'{"input_ids": [1, 2], "stream": true}', {}), "r" * 32)
    attempt = LegRecord("e0", "aggregated", "w0", {}, worker=w)
    reader = Reader(ex)
    leg = Leg(RequestState("r", "sglang", "/generate", "POST"), Settings(), w, attempt, ex.worker_request(attempt), 300.0)
    async with anyio.create_task_group() as tg:
        async def lose() -> None:
            await anyio.wait_all_tasks_blocked()
            (held,) = w.inflight
            assert held is leg
            held.worker_lost(w, "health probe failed")
        tg.start_soon(lose)
        end = await leg.run(reader, FakeRouter())
    assert (end, leg.lost, attempt.live, attempt.outcome) == (LegEnd.CANCELLED, "health probe failed", True, "worker_lost")
    assert reader.events == [([5], None)] and w.inflight == set()


# -- the handshakes ------------------------------------------------------------------


def test_each_pd_protocol_has_a_handshake_and_each_plan_its_own():
    assert set(PAIRS) == {p.pd for p in PROTOCOLS.values() if p.pd} == {"concurrent", "sequential"}
    one, pre, dec = (worker(i, "vllm", FakePool()) for i in ("w0", "w1", "w2"))
    assert handshake((one,)) is AGGREGATED
    assert handshake((pre, dec)) is SEQUENTIAL_PAIR
    assert handshake((worker("w3", "sglang", FakePool()), dec)) is CONCURRENT_PAIR


#: What an SGLang stream's client gets for ``answer([5], None)``.
FIRST = b'data: {"text":"","output_ids":[5],"meta_info":{"id":"mine","finish_reason":null}}\n\n'


def answer(ids_: list[int], finish: dict | None, **meta) -> dict:
    return {"text": "", "output_ids": ids_, "meta_info": {"id": "e0", "finish_reason": finish, **meta}}


@pytest.mark.anyio
async def test_aggregated_sends_the_clients_body_and_answers_with_its_id(minted):
    done = answer([5, 6], {"type": "length", "length": 2}, completion_tokens=2)
    pool = FakePool(FakeResponse(200, [orjson.dumps(done)]))
    client = Client(SGLangCodec(), {"input_ids": [1, 2], "rid": "mine"}, FakeRouter((worker("w0", "sglang", pool),)))
    await client.run()
    assert pool.sent == [(b"/generate", {"input_ids": [1, 2], "rid": "e0"}, [])]
    assert client.status == 200
    assert orjson.loads(client.body) == {**done, "meta_info": {**done["meta_info"], "id": "mine"}}
    assert client.attempts() == [("e0", "aggregated", "w0", "finished", False)]
    assert (client.st.status, client.st.output_tokens, client.aborts) == ("ok", 2, [])


@pytest.mark.anyio
async def test_aggregated_stream_fails_over_before_the_first_token_then_streams(minted):
    dead = FakePool(ConnectFailed("connection refused"))
    chunks = [answer([5], None), answer([5, 6], {"type": "stop"})]
    live = FakePool(FakeResponse(200, [sse(chunks[0]), sse(chunks[1]) + b"data: [DONE]\n\n"]))
    router = FakeRouter((worker("w0", "sglang", dead),), (worker("w1", "sglang", live),))
    client = Client(SGLangCodec(), {"input_ids": [1, 2], "rid": "mine", "stream": True}, router)
    await client.run()
    assert [s[1]["rid"] for s in dead.sent + live.sent] == ["e0", "e1"]
    assert router.marked == [("w0", "connection refused")]
    assert client.body == FIRST + (
        b'data: {"text":"","output_ids":[5,6],"meta_info":{"id":"mine","finish_reason":{"type":"stop"}}}\n\n'
        b"data: [DONE]\n\n"
    )
    assert client.attempts() == [("e0", "aggregated", "w0", "connect_failed", False),
                                 ("e1", "aggregated", "w1", "finished", False)]


@pytest.mark.anyio
async def test_aggregated_stream_migrates_when_its_worker_is_lost_mid_answer(minted):
    first = FakePool(FakeResponse(200, [sse(answer([5], None)), BROKEN]))
    second = FakePool(FakeResponse(200, [sse(answer([6], {"type": "length", "length": 1})), None]))
    router = FakeRouter((worker("w0", "sglang", first),), (worker("w1", "sglang", second),), probe_up=False)
    body = {"input_ids": [1, 2], "rid": "mine", "stream": True, "sampling_params": {"max_new_tokens": 2}}
    client = Client(SGLangCodec(), body, router)
    await client.run()
    assert second.sent[0][1] == {"input_ids": [1, 2, 5], "rid": "e1", "stream": True,
                                 "sampling_params": {"max_new_tokens": 1}}
    assert client.body == FIRST + (
        b'data: {"text":"","output_ids":[5,6],"meta_info":{"id":"mine","finish_reason":{"type":"length","length":2}}}\n\n'
        b"data: [DONE]\n\n"
    )
    assert client.attempts() == [("e0", "aggregated", "w0", "worker_lost", False),
                                 ("e1", "resumed", "w1", "finished", False)]
    assert (client.st.migrations, client.st.output_tokens) == (1, 2)
    # The lost leg is aborted like any live one (its worker is gone).
    assert client.aborts == [("w0", "e0")]


SGLANG_PAIR_BODY = {"input_ids": [1, 2], "rid": "mine", "stream": True}
BOOTSTRAP = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 7}


@pytest.mark.anyio
async def test_sglang_pair_sends_both_legs_the_bootstrap_room_and_streams_the_decode(minted):
    prefill = FakePool(FakeResponse(200, [sse(answer([9], {"type": "length", "length": 1})), None]))
    decode = FakePool(FakeResponse(200, [sse(answer([5], None)), sse(answer([5, 6], {"type": "stop"})), None]))
    plan = (worker("w0", "sglang", prefill, "prefill"), worker("w1", "sglang", decode, "decode"))
    client = Client(SGLangCodec(), SGLANG_PAIR_BODY, FakeRouter(plan))
    await client.run()
    assert prefill.sent == [(b"/generate", {**SGLANG_PAIR_BODY, "rid": "e0", **BOOTSTRAP}, [])]
    assert decode.sent == [(b"/generate", {**SGLANG_PAIR_BODY, "rid": "e1", **BOOTSTRAP}, [])]
    assert client.body == FIRST + (
        b'data: {"text":"","output_ids":[5,6],"meta_info":{"id":"mine","finish_reason":{"type":"stop"}}}\n\n'
        b"data: [DONE]\n\n"
    )
    assert client.attempts() == [("e0", "prefill", "w0", "finished", False), ("e1", "decode", "w1", "finished", False)]
    assert handshakes._live_rooms == set()


@pytest.mark.anyio
async def test_sglang_pair_whose_prefill_cannot_connect_is_aborted_and_runs_on_another_pair(minted):
    p0 = FakePool(ConnectFailed("connection refused"))
    d0 = FakePool(STALL)
    p1 = FakePool(FakeResponse(200, [sse(answer([9], {"type": "length", "length": 1})), None]))
    d1 = FakePool(FakeResponse(200, [sse(answer([5], {"type": "stop"})), None]))
    first = (worker("w0", "sglang", p0, "prefill"), worker("w1", "sglang", d0, "decode"))
    second = (worker("w2", "sglang", p1, "prefill"), worker("w3", "sglang", d1, "decode"))
    client = Client(SGLangCodec(), SGLANG_PAIR_BODY, FakeRouter(first, second))
    await client.run()
    assert [s[1]["rid"] for s in p0.sent + d0.sent + p1.sent + d1.sent] == ["e0", "e1", "e2", "e3"]
    assert client.aborts == [("w1", "e1")]  # the decode leg left waiting, at once
    assert client.attempts() == [
        ("e0", "prefill", "w0", "connect_failed", False), ("e1", "decode", "w1", "aborted", False),
        ("e2", "prefill", "w2", "finished", False), ("e3", "decode", "w3", "finished", False),
    ]
    assert client.body.endswith(b"data: [DONE]\n\n") and client.st.status == "ok"


@pytest.mark.anyio
async def test_sglang_prefill_error_page_is_the_answer(minted):
    p = FakePool(FakeResponse(400, [b'{"error": {"message": "bad"}}']))
    d = FakePool(STALL)
    plan = (worker("w0", "sglang", p, "prefill"), worker("w1", "sglang", d, "decode"))
    client = Client(SGLangCodec(), {"input_ids": [1, 2], "rid": "mine"}, FakeRouter(plan))
    await client.run()
    assert (client.status, client.body) == (400, b'{"error": {"message": "bad"}}')
    assert (client.st.status, client.st.http_status, client.aborts) == ("rejected", 400, [("w1", "e1")])


VLLM_BODY = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4, "min_tokens": 2}, "stream": True}
KV = {"do_remote_prefill": True, "remote_block_ids": [1], "remote_engine_id": "p"}
VLLM_HEADERS = [(b"content-type", b"application/json"), (b"x-request-id", b"e0")]


def vllm_prefill_answer(kv) -> bytes:
    return orjson.dumps({"request_id": "generate-tokens-e0", "choices": [
        {"index": 0, "token_ids": [9], "finish_reason": "length"}], "kv_transfer_params": kv})


def vllm_decode(*reads) -> FakePool:
    return FakePool(FakeResponse(200, [*reads, None]))


VLLM_CHUNKS = (
    sse({"request_id": "x", "choices": [{"index": 0, "token_ids": [5], "finish_reason": None}]}),
    sse({"request_id": "x", "choices": [{"index": 0, "token_ids": [6], "finish_reason": "length"}]}),
    sse({"request_id": "x", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}, b"[DONE]"),
)
VLLM_CLIENT = (
    b'data: {"request_id":"generate-tokens-rrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrr","choices":[{"index":0,"token_ids":[5],'
    b'"finish_reason":null}]}\n\n'
    b'data: {"request_id":"generate-tokens-rrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrr","choices":[{"index":0,"token_ids":[6],'
    b'"finish_reason":"length"}]}\n\n'
    b"data: [DONE]\n\n"
)


@pytest.mark.anyio
async def test_vllm_pair_prefills_one_token_then_decodes_with_its_kv_transfer_params(minted):
    p = FakePool(FakeResponse(200, [vllm_prefill_answer(KV)]))
    d = vllm_decode(*VLLM_CHUNKS)
    plan = (worker("w0", "vllm", p, "prefill"), worker("w1", "vllm", d, "decode"))
    client = Client(VLLMCodec(), VLLM_BODY, FakeRouter(plan))
    await client.run()
    prefill_kv = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
    assert p.sent == [(b"/inference/v1/generate", {
        "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 1, "ignore_eos": True}, "stream": False,
        "kv_transfer_params": prefill_kv}, VLLM_HEADERS)]
    assert d.sent == [(b"/inference/v1/generate", {
        **VLLM_BODY, "kv_transfer_params": KV,
        "stream_options": {"include_usage": True, "continuous_usage_stats": False}}, VLLM_HEADERS)]
    assert client.body == VLLM_CLIENT
    assert client.attempts() == [("e0", "prefill", "w0", "finished", False), ("e0", "decode", "w1", "finished", False)]


@pytest.mark.anyio
@pytest.mark.parametrize("fallback", [False, True])
async def test_vllm_prefill_without_kv_transfer_params_fails_or_prefills_locally(minted, fallback):
    from asgi_generate.tracing.record import build_record

    p = FakePool(FakeResponse(200, [vllm_prefill_answer(None)]))
    d = vllm_decode(*VLLM_CHUNKS)
    plan = (worker("w0", "vllm", p, "prefill"), worker("w1", "vllm", d, "decode"))
    client = Client(VLLMCodec(), VLLM_BODY, FakeRouter(plan), pd_fallback=fallback)
    await client.run()
    if not fallback:
        assert d.sent == []
        assert (client.status, client.body) == (502, b'{"error":{"message":"the prefill worker answered no '
                                                     b'kv_transfer_params","type":"Bad Gateway","param":null,'
                                                     b'"code":502}}')
        assert client.attempts() == [("e0", "prefill", "w0", "finished", False)]
        return
    assert d.sent[0][1] == {**VLLM_BODY, "stream_options": {"include_usage": True, "continuous_usage_stats": False}}
    assert dict(d.sent[0][2])[b"x-request-id"] == b"e0"
    assert client.body == VLLM_CLIENT
    client.st.t_done = client.st.t_received
    rows = build_record(client.st, 16)["attempts"]
    assert [(r["role"], r.get("local_prefill")) for r in rows] == [("prefill", None), ("decode", True)]


@pytest.mark.anyio
async def test_a_leg_does_not_hold_its_request_body():
    # The attempt loop keeps its WorkerRequest for the leg's whole life; the
    # body (a whole prompt's JSON) goes to the pool and is not kept there.
    from asgi_generate.tracing.state import RequestState
    from asgi_generate.sdk._codec import WorkerRequest
    from asgi_generate.config import Settings
    from asgi_generate.request.legs import Leg

    sent = []

    class Pool:
        def request(self, method, path, body, headers, head_deadline):
            sent.append((method, path, body, headers))
            return object()

    class Worker:
        id, pool = "w0", Pool()

    wreq = WorkerRequest(b"/generate", b'{"input_ids":[1,2,3]}', [(b"x-a", b"1")])
    leg = Leg(RequestState("r", "sglang", "/generate", "POST"), Settings(), Worker(), LegRecord("a" * 32, "aggregated"),
              wreq)
    assert sent == [(b"POST", b"/generate", b'{"input_ids":[1,2,3]}', [(b"x-a", b"1")])]
    assert wreq.body == b"" and wreq.stream is True and leg.phase == "headers"
