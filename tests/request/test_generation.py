"""The attempt loop (asgi_generate/request/generation.py) in process, over
fake workers that answer from a script (tests/request/test_legs.py's): when
it retries on another worker, when a stream migrates, and when it gives up,
with the exact worker bodies, client bytes and error messages."""

from __future__ import annotations

import anyio
import orjson
import pytest

from asgi_generate.request.generation import migration_backoff
from asgi_generate.exceptions import ConnectFailed, TimedOut
from asgi_generate_sglang import SGLangCodec
from asgi_generate_vllm import VLLMCodec
from test_legs import (BROKEN, FIRST, STALL, Client, FakePool, FakeResponse, FakeRouter, answer, anyio_backend,  # noqa: F401
                       minted, sse, worker)

STREAM = {"input_ids": [1, 2], "rid": "mine", "stream": True, "sampling_params": {"max_new_tokens": 2}}


def lost() -> FakeResponse:
    """A stream whose worker breaks the connection after one token."""
    return FakeResponse(200, [sse(answer([5], None)), BROKEN])


class Router(FakeRouter):
    """The fake router, saying why it has no plan as the real one does."""

    def unavailable(self, protocol, key=None):
        return f"no healthy worker for protocol {protocol!r}"


def _error(client: Client) -> dict:
    """The in-band error event that ends ``client``'s SGLang stream."""
    events = [block[6:] for block in client.body.split(b"\n\n") if block.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    return orjson.loads(events[-2])


def test_migration_backoff_doubles_from_50_ms_up_to_one_second():
    assert [migration_backoff(k) for k in range(1, 8)] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]


@pytest.mark.anyio
async def test_no_plan_is_a_503_naming_why(minted):
    client = Client(SGLangCodec(), STREAM, Router())
    await client.run()
    assert client.status == 503
    assert orjson.loads(client.body) == {"object": "error", "message": "no healthy worker for protocol 'sglang'",
                                         "type": "503", "param": None, "code": 503}
    assert (client.st.status, client.st.attempts, client.aborts) == ("unavailable", [], [])


@pytest.mark.anyio
async def test_every_worker_refusing_connections_is_tried_once_then_a_503(minted):
    pools = [FakePool(ConnectFailed("connection refused")) for _ in range(2)]
    router = Router(*((worker(f"w{i}", "sglang", p),) for i, p in enumerate(pools)))
    client = Client(SGLangCodec(), STREAM, router)
    await client.run()
    assert [s[1]["rid"] for p in pools for s in p.sent] == ["e0", "e1"]
    assert router.marked == [("w0", "connection refused"), ("w1", "connection refused")]
    assert client.status == 503
    assert client.attempts() == [("e0", "aggregated", "w0", "connect_failed", False),
                                 ("e1", "aggregated", "w1", "connect_failed", False)]


@pytest.mark.anyio
async def test_a_stream_whose_worker_answers_503_before_any_token_fails_over(minted):
    going = FakePool(FakeResponse(503, [b'{"error": "shutting down"}']))
    live = FakePool(FakeResponse(200, [sse(answer([5], None)), sse(answer([5, 6], {"type": "stop"})), None]))
    router = Router((worker("w0", "sglang", going),), (worker("w1", "sglang", live),))
    client = Client(SGLangCodec(), STREAM, router)
    await client.run()
    assert [s[1]["rid"] for s in going.sent + live.sent] == ["e0", "e1"]
    assert client.body == FIRST + (
        b'data: {"text":"","output_ids":[5,6],"meta_info":{"id":"mine","finish_reason":{"type":"stop"}}}\n\n'
        b"data: [DONE]\n\n")
    assert client.attempts() == [("e0", "aggregated", "w0", "error", False),
                                 ("e1", "aggregated", "w1", "finished", False)]
    assert (client.st.migrations, client.st.status) == (0, "ok")


@pytest.mark.anyio
async def test_a_unary_503_is_the_engines_answer_not_a_failover(minted):
    going = FakePool(FakeResponse(503, [b'{"error": "aborted"}']))
    router = Router((worker("w0", "sglang", going),), (worker("w1", "sglang", FakePool()),))
    client = Client(SGLangCodec(), {"input_ids": [1, 2], "rid": "mine"}, router)
    await client.run()
    assert (client.status, client.body) == (503, b'{"error": "aborted"}')
    assert client.attempts() == [("e0", "aggregated", "w0", "error", False)]
    assert client.st.status == "engine_error"


@pytest.mark.anyio
async def test_a_stream_silent_past_the_inter_token_deadline_migrates_and_its_leg_is_aborted(minted):
    silent = FakePool(FakeResponse(200, [sse(answer([5], None)), TimedOut("deadline")]))
    second = FakePool(FakeResponse(200, [sse(answer([6], {"type": "length", "length": 1})), None]))
    router = Router((worker("w0", "sglang", silent),), (worker("w1", "sglang", second),))
    client = Client(SGLangCodec(), STREAM, router)
    await client.run()
    assert second.sent[0][1] == {"input_ids": [1, 2, 5], "rid": "e1", "stream": True,
                                 "sampling_params": {"max_new_tokens": 1}}
    assert client.attempts() == [("e0", "aggregated", "w0", "timeout", False),
                                 ("e1", "resumed", "w1", "finished", False)]
    assert (client.st.migrations, client.st.output_tokens, client.st.status) == (1, 2, "ok")
    assert router.marked == []  # slow is not dead
    assert client.aborts == [("w0", "e0")]


@pytest.mark.anyio
async def test_a_stream_at_its_migration_limit_ends_with_an_in_band_502_naming_it(minted):
    pools = [FakePool(FakeResponse(200, [sse(answer([5], None)), BROKEN])),
             FakePool(FakeResponse(200, [sse(answer([6], None)), BROKEN])),
             FakePool()]
    router = Router(*((worker(f"w{i}", "sglang", p),) for i, p in enumerate(pools)), probe_up=False)
    client = Client(SGLangCodec(), {**STREAM, "sampling_params": {"max_new_tokens": 4}}, router, migration_limit=1)
    await client.run()
    assert client.status == 200
    assert client.body.startswith(FIRST)
    assert _error(client) == {"error": {
        "message": "worker w1 failed: worker closed the connection mid-response (migration limit 1 reached)",
        "type": "502", "code": 502}}
    assert client.attempts() == [("e0", "aggregated", "w0", "worker_lost", False),
                                 ("e1", "resumed", "w1", "worker_lost", False)]
    assert (client.st.migrations, client.st.output_tokens, client.st.status) == (1, 2, "engine_error")
    assert pools[2].sent == []


@pytest.mark.anyio
async def test_a_stream_with_no_worker_left_ends_with_an_in_band_502_saying_so(minted):
    router = Router((worker("w0", "sglang", FakePool(lost())),), probe_up=False)
    client = Client(SGLangCodec(), STREAM, router)
    await client.run()
    assert _error(client) == {"error": {
        "message": "worker w0 failed: worker closed the connection mid-response "
                   "(migration impossible: no worker left to resume on)",
        "type": "502", "code": 502}}
    assert client.attempts() == [("e0", "aggregated", "w0", "worker_lost", False)]
    assert (client.st.migrations, client.st.output_tokens, client.st.status) == (0, 1, "engine_error")


@pytest.mark.anyio
async def test_migration_off_never_moves_a_stream(minted):
    other = FakePool()
    router = Router((worker("w0", "sglang", FakePool(lost())),), (worker("w1", "sglang", other),), probe_up=False)
    client = Client(SGLangCodec(), STREAM, router, migration_limit=0)
    await client.run()
    assert _error(client) == {"error": {"message": "worker w0 failed: worker closed the connection mid-response",
                                        "type": "502", "code": 502}}
    assert other.sent == []
    assert client.st.migrations == 0


@pytest.mark.anyio
async def test_a_unary_request_whose_worker_is_lost_is_replayed_from_scratch(minted):
    lost = FakePool(FakeResponse(200, [b'{"text": "", "out', BROKEN]))
    done = answer([5, 6], {"type": "length", "length": 2})
    second = FakePool(FakeResponse(200, [orjson.dumps({**done, "meta_info": {**done["meta_info"], "id": "e1"}})]))
    router = Router((worker("w0", "sglang", lost),), (worker("w1", "sglang", second),), probe_up=False)
    client = Client(SGLangCodec(), {"input_ids": [1, 2], "rid": "mine"}, router)
    await client.run()
    assert second.sent == [(b"/generate", {"input_ids": [1, 2], "rid": "e1"}, [])]
    assert client.status == 200
    assert orjson.loads(client.body)["output_ids"] == [5, 6]
    assert client.attempts() == [("e0", "aggregated", "w0", "worker_lost", False),
                                 ("e1", "replayed", "w1", "finished", False)]
    assert (client.st.replays, client.st.migrations, client.st.status) == (1, 0, "ok")


@pytest.mark.anyio
async def test_a_vllm_stream_migrates_with_its_tokens_appended_to_the_prompt(minted):
    def chunk(ids_, finish=None):
        return {"request_id": "e0", "choices": [{"index": 0, "token_ids": ids_, "finish_reason": finish}]}

    first = FakePool(FakeResponse(200, [sse(chunk([5])), BROKEN]))
    second = FakePool(FakeResponse(200, [sse(chunk([6], "length"), b"[DONE]"), None]))
    router = Router((worker("w0", "vllm", first),), (worker("w1", "vllm", second),), probe_up=False)
    body = {"token_ids": [1, 2], "request_id": "mine", "stream": True, "sampling_params": {"max_tokens": 2}}
    client = Client(VLLMCodec(), body, router)
    await client.run()
    resumed = second.sent[0][1]
    assert (resumed["token_ids"], resumed["sampling_params"]["max_tokens"]) == ([1, 2, 5], 1)
    assert client.attempts() == [("e0", "aggregated", "w0", "worker_lost", False),
                                 ("e1", "resumed", "w1", "finished", False)]
    assert (client.st.migrations, client.st.output_tokens, client.st.status) == (1, 2, "ok")


@pytest.mark.anyio
@pytest.mark.parametrize("tokens", [0, 1])
async def test_a_stream_whose_worker_the_probe_gives_up_fails_over_before_a_token_and_migrates_after(minted, tokens):
    """The health probe may notice a dead worker before the leg reads the
    broken connection: before any token reached the client that is the same
    failover as a broken connection's, not a migration of zero tokens."""
    first = FakePool(FakeResponse(200, [sse(answer([5], None))] * tokens + [STALL]))
    done = [5, 6] if tokens else [6, 7]
    second = FakePool(FakeResponse(200, [sse(answer(done, {"type": "length", "length": 2})), None]))
    w0 = worker("w0", "sglang", first)
    router = Router((w0,), (worker("w1", "sglang", second),))
    client = Client(SGLangCodec(), STREAM, router)
    async with anyio.create_task_group() as tg:
        async def lose() -> None:
            await anyio.wait_all_tasks_blocked()
            (leg,) = w0.inflight
            leg.worker_lost(w0, "health probe failed")
        tg.start_soon(lose)
        await client.run()
    body = second.sent[0][1]
    if tokens:
        assert (body["input_ids"], body["sampling_params"], body["rid"]) == ([1, 2, 5], {"max_new_tokens": 1}, "e1")
        assert client.attempts() == [("e0", "aggregated", "w0", "worker_lost", False),
                                     ("e1", "resumed", "w1", "finished", False)]
        assert (client.st.migrations, client.st.status) == (1, "ok")
    else:
        assert (body["input_ids"], body["sampling_params"], body["rid"]) == ([1, 2], {"max_new_tokens": 2}, "e1")
        assert client.attempts() == [("e0", "aggregated", "w0", "worker_lost", False),
                                     ("e1", "aggregated", "w1", "finished", False)]
        assert (client.st.migrations, client.st.status) == (0, "ok")
    assert client.aborts == [("w0", "e0")]


@pytest.mark.anyio
async def test_a_worker_lost_during_a_client_write_still_delivers_the_rest_of_that_read(minted):
    """The health probe gives the worker up while the stream's first write
    (its head) is under way: the leg ends only once every event of that
    worker read reached the client, so the stream resumes after the tokens
    the client has, none lost between the two legs."""
    chunks = b"".join(sse(answer(ids, None)) for ids in ([5], [5, 6], [5, 6, 7]))
    first = FakePool(FakeResponse(200, [chunks, STALL]))
    second = FakePool(FakeResponse(200, [sse(answer([8], {"type": "length", "length": 1})), None]))
    w0 = worker("w0", "sglang", first)
    router = Router((w0,), (worker("w1", "sglang", second),))

    class LostDuringTheHead(Client):
        async def send(self, message: dict) -> None:
            if message["type"] == "http.response.start":
                (leg,) = w0.inflight
                leg.worker_lost(w0, "health probe failed")
            await anyio.sleep(0)  # a server's send is a checkpoint: cancelled there, nothing went out
            await super().send(message)

    client = LostDuringTheHead(SGLangCodec(), {**STREAM, "sampling_params": {"max_new_tokens": 4}}, router)
    await client.run()
    assert second.sent[0][1]["input_ids"] == [1, 2, 5, 6, 7]
    outputs = [orjson.loads(block[6:])["output_ids"] for block in client.body.split(b"\n\n")
               if block.startswith(b"data: {")]
    assert outputs == [[5], [5, 6], [5, 6, 7], [5, 6, 7, 8]]
    assert client.attempts() == [("e0", "aggregated", "w0", "worker_lost", False),
                                 ("e1", "resumed", "w1", "finished", False)]
    assert (client.st.migrations, client.st.output_tokens, client.st.status) == (1, 4, "ok")
