"""The trace writer in process: queue, batches, sinks, rotation, drop
counters, shutdown flush, setup errors, and the app's wiring (tracing off
costs nothing; rejections on a matched route leave a record)."""

from __future__ import annotations

import logging
import os
import threading

import anyio
import orjson
import pytest

from asgi_generate.tracing.state import RequestState
from asgi_generate.server.app import App
from asgi_generate.assets import TOKENIZER_PATH
from asgi_generate.sdk._codec import Codec, RequestError, Route
from asgi_generate.config import Settings
from asgi_generate.sdk._registry import LoadedCodec
from asgi_generate.tracing import Tracer, TraceSetupError
from asgi_generate.tracing.record import build_record
from asgi_generate.tracing.sinks import Sink
from asgi_generate.tracing.offline.validate import check_records, read_jsonl

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


def done(i: int) -> RequestState:
    st = RequestState(f"{i:032x}", "sglang", "/generate", "POST", received_unix_ms=1_700_000_000_000,
                      t_received=10.0, status="ok", http_status=200, finish_reason="stop",
                      input_ids=[1, 2, 3], input_length=3, stream=False)
    st.t_done = 10.5
    return st


def lines(paths) -> list[dict]:
    out = []
    for p in sorted(paths):
        count, problems = check_records(read_jsonl(str(p)))
        assert problems == []
        out += [orjson.loads(line) for line in p.read_bytes().splitlines()]
    return out


class MemorySink(Sink):
    name = "memory"

    def __init__(self) -> None:
        super().__init__()
        self.data = b""

    def write(self, data: bytes) -> None:
        self.data += data


class FailingSink(Sink):
    name = "failing"

    def write(self, data: bytes) -> None:
        raise OSError(28, "No space left on device")


class GatedSink(MemorySink):
    """Blocks each write until released: a slow disk."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()

    def write(self, data: bytes) -> None:
        self.entered.set()
        assert self.release.wait(10)
        super().write(data)


async def wait_for(predicate) -> None:
    with anyio.fail_after(5):
        while not predicate():
            await anyio.sleep(0.005)


async def test_every_record_reaches_one_file_per_process(tmp_path):
    tracer = Tracer(Settings(trace_file=str(tmp_path / "trace.jsonl")))
    async with anyio.create_task_group() as tg:
        await tg.start(tracer.run)
        for i in range(1, 11):
            tracer.submit(done(i))
        await tracer.close()
    files = list(tmp_path.iterdir())
    assert len(files) == 1
    name = files[0].name.split(".")
    assert (name[0], name[1], name[3], name[4]) == ("trace", str(os.getpid()), "0000", "jsonl")
    assert [r["request_id"] for r in lines(files)] == [f"{i:032x}" for i in range(1, 11)]
    stats = tracer.stats()
    assert stats["submitted"] == stats["records"] == 10
    assert stats["dropped"] == {"queue_full": 0, "sink_error": 0, "build_error": 0, "closed": 0}
    assert stats["sinks"]["file"] == {"written": 10, "failed": 0, "path": str(files[0]), "rotations": 0}


async def test_a_full_queue_drops_and_counts(tmp_path):
    tracer = Tracer(Settings(trace_file=str(tmp_path / "t"), trace_queue_size=2))
    for i in range(1, 6):
        tracer.submit(done(i))
    assert tracer.stats()["queued"] == 2
    async with anyio.create_task_group() as tg:
        await tg.start(tracer.run)
        await tracer.close()
    assert [r["request_id"] for r in lines(tmp_path.iterdir())] == [f"{i:032x}" for i in (1, 2)]
    assert tracer.dropped == {"queue_full": 3, "sink_error": 0, "build_error": 0, "closed": 0}


def test_a_loss_is_logged_when_it_starts_then_at_most_every_minute(caplog, monkeypatch):
    from asgi_generate.tracing import writer

    now = [100.0]
    monkeypatch.setattr(writer, "time", type("Clock", (), {"monotonic": staticmethod(lambda: now[0])}))
    tracer = Tracer(Settings(trace_stderr=True, trace_queue_size=1))
    with caplog.at_level(logging.WARNING, logger="asgi_generate.tracing"):
        for i in range(1, 5):
            tracer.submit(done(i))
        now[0] += 59.0
        tracer.submit(done(5))
        now[0] += 1.0
        tracer.submit(done(6))
    so_far = "{'queue_full': %d, 'sink_error': 0, 'build_error': 0, 'closed': 0}"
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, f"trace: dropping records (1 queue_full now); dropped so far {so_far % 1}; see /stats trace"),
        (logging.WARNING, f"trace: dropping records (1 queue_full now); dropped so far {so_far % 5}; see /stats trace"),
    ]


async def test_a_requests_items_wait_in_half_the_queue_and_singles_find_room(tmp_path):
    """100 items through a 16-record queue (theirs: 8 at a time) while single
    records arrive every 20 ms: every record is written, none dropped."""
    tracer = Tracer(Settings(trace_file=str(tmp_path / "t.jsonl"), trace_queue_size=16))
    assert tracer.items_share == 8
    async with anyio.create_task_group() as tg:
        await tg.start(tracer.run)
        async with anyio.create_task_group() as requests:
            requests.start_soon(tracer.submit_items, [done(i) for i in range(1000, 1100)])
            for i in range(1, 31):
                await anyio.sleep(0.02)
                tracer.submit(done(i))
        await tracer.close()
    assert tracer.dropped == {"queue_full": 0, "sink_error": 0, "build_error": 0, "closed": 0}
    written = sorted(int(r["request_id"], 16) for r in lines(tmp_path.iterdir()))
    assert written == [*range(1, 31), *range(1000, 1100)]
    assert tracer.submitted == tracer.records == 130


async def test_items_that_find_the_writer_closed_are_counted():
    tracer = Tracer(Settings(trace_stderr=True, trace_queue_size=4))
    await tracer.close()
    await tracer.submit_items([done(i) for i in range(3)])
    assert tracer.dropped == {"queue_full": 0, "sink_error": 0, "build_error": 0, "closed": 3}


async def test_a_batch_is_written_as_one_line_per_record_each_ending_with_a_newline():
    tracer = Tracer(Settings(trace_stderr=True))
    memory = MemorySink()
    tracer.sinks = [memory]
    batch = [done(i) for i in range(1, 4)]
    tracer._write_batch(batch)
    assert memory.data == b"".join(orjson.dumps(build_record(st, tracer.block_size)) + b"\n" for st in batch)
    assert memory.data.count(b"\n") == memory.written == tracer.records == 3
    await tracer.close()


async def test_a_failing_sink_drops_and_counts_while_others_write(caplog):
    tracer = Tracer(Settings(trace_stderr=True))
    failing, memory = FailingSink(), MemorySink()
    tracer.sinks = [failing, memory]
    async with anyio.create_task_group() as tg:
        await tg.start(tracer.run)
        for i in range(1, 4):
            tracer.submit(done(i))
        await wait_for(lambda: tracer.records == 3)
        tracer.submit(done(4))
        with caplog.at_level(logging.INFO, logger="asgi_generate.tracing"):
            await tracer.close()
    assert len(memory.data.splitlines()) == memory.written == 4
    assert (failing.written, failing.failed) == (0, 4)
    assert tracer.dropped["sink_error"] == 4
    assert tracer.stats()["sinks"] == {"failing": {"written": 0, "failed": 4}, "memory": {"written": 4, "failed": 0}}
    last = caplog.records[-1]
    assert last.levelno == logging.WARNING
    assert last.getMessage().startswith(
        "trace: 4 requests, 4 records, dropped {'queue_full': 0, 'sink_error': 4, 'build_error': 0, 'closed': 0}"
    )


async def test_rotation_by_size_never_splits_a_batch(tmp_path):
    tracer = Tracer(Settings(trace_file=str(tmp_path / "t.jsonl"), trace_rotate_bytes=1))
    async with anyio.create_task_group() as tg:
        await tg.start(tracer.run)
        for i in range(1, 4):
            tracer.submit(done(i))
            await wait_for(lambda i=i: tracer.records == i)
        await tracer.close()
    files = sorted(tmp_path.iterdir())
    assert [f.name.rsplit(".", 2)[1] for f in files] == ["0000", "0001", "0002"]
    assert [len(f.read_bytes().splitlines()) for f in files] == [1, 1, 1]
    assert len(lines(files)) == 3
    assert tracer.stats()["sinks"]["file"]["rotations"] == 3


class HalfWritingFile:
    """A file whose write stores half the data, then fails: a full disk."""

    def __init__(self, f) -> None:
        self.f = f

    def write(self, data: bytes) -> None:
        self.f.write(data[: len(data) // 2])
        self.f.flush()
        raise OSError(28, "No space left on device")

    def close(self) -> None:
        self.f.close()


async def test_records_after_a_failed_write_stay_whole(tmp_path):
    tracer = Tracer(Settings(trace_file=str(tmp_path / "t.jsonl")))
    async with anyio.create_task_group() as tg:
        await tg.start(tracer.run)
        sink = tracer.sinks[0]
        tracer.submit(done(1))
        await wait_for(lambda: tracer.records == 1)
        sink._file = HalfWritingFile(sink._file)
        tracer.submit(done(2))
        await wait_for(lambda: tracer.records == 2)
        tracer.submit(done(3))
        await tracer.close()
    (path,) = tmp_path.iterdir()
    raw = path.read_bytes().splitlines()
    assert len(raw) == 3
    assert [orjson.loads(raw[i])["request_id"] for i in (0, 2)] == [f"{1:032x}", f"{3:032x}"]
    count, problems = check_records(read_jsonl(str(path)))
    assert count == 3 and len(problems) == 1 and problems[0].startswith(f"{path}:2: not JSON")
    assert tracer.dropped["sink_error"] == 1
    assert tracer.stats()["sinks"]["file"]["written"] == 2


async def test_stderr_sink(capfd):
    tracer = Tracer(Settings(trace_stderr=True))
    async with anyio.create_task_group() as tg:
        await tg.start(tracer.run)
        tracer.submit(done(7))
        await tracer.close()
    err = capfd.readouterr().err
    rec = orjson.loads(err.splitlines()[0])
    assert (rec["request_id"], rec["status"]) == (f"{7:032x}", "ok")


async def test_build_errors_are_counted_and_the_rest_written():
    tracer = Tracer(Settings(trace_stderr=True))
    memory = MemorySink()
    tracer.sinks = [memory]
    broken = done(2)
    broken.t_done = None  # a handler bug: never finished
    async with anyio.create_task_group() as tg:
        await tg.start(tracer.run)
        for st in (done(1), broken, done(3)):
            tracer.submit(st)
        await tracer.close()
    assert [orjson.loads(x)["request_id"] for x in memory.data.splitlines()] == [f"{1:032x}", f"{3:032x}"]
    assert tracer.dropped["build_error"] == 1


async def test_records_the_writer_never_took_are_counted():
    tracer = Tracer(Settings(trace_stderr=True))
    tracer.submit(done(1))
    tracer.submit(done(2))
    await tracer.close()  # the writer never ran
    tracer.submit(done(3))  # too late
    assert tracer.dropped == {"queue_full": 0, "sink_error": 0, "build_error": 0, "closed": 3}


async def test_a_cancelled_writer_finishes_its_batch_and_counts_the_rest():
    tracer = Tracer(Settings(trace_stderr=True))
    gated = GatedSink()
    tracer.sinks = [gated]
    async with anyio.create_task_group() as tg:
        await tg.start(tracer.run)
        tracer.submit(done(1))
        await anyio.to_thread.run_sync(gated.entered.wait, 5)
        tracer.submit(done(2))
        tracer.submit(done(3))
        tg.cancel_scope.cancel()
        gated.release.set()
    assert gated.written == 1
    assert tracer.dropped["closed"] == 2


@pytest.mark.parametrize("kw, message", [
    ({}, "tracing needs --trace-file, --trace-stderr or --otlp-endpoint"),
    ({"trace_stderr": True, "trace_queue_size": 0}, "--trace-queue-size and --trace-block-size must be at least 1"),
    ({"trace_stderr": True, "trace_block_size": 0}, "--trace-queue-size and --trace-block-size must be at least 1"),
    ({"trace_stderr": True, "reasoning_parser": "qwen3"}, "--reasoning-parser and --tool-call-parser need --tokenizer"),
    ({"trace_stderr": True, "tokenizer": str(TOKENIZER_PATH), "tool_call_parser": "nope"},
     "unknown tool_call parser 'nope' (known: hermes)"),
    ({"trace_stderr": True, "tokenizer": "/nonexistent.json", "reasoning_parser": "qwen3"},
     "cannot load tokenizer '/nonexistent.json'"),
])
def test_setup_errors(kw, message):
    with pytest.raises(TraceSetupError) as info:
        Tracer(Settings(**kw))
    assert str(info.value).startswith(message)


# -- the app's wiring -----------------------------------------------------------


class StubCodec(Codec):
    """Rejects everything, the way a format with models and media types does."""

    name = "stub"
    routes = (Route("POST", "/stub/generate"),)
    worker_protocol = "sglang"

    def decode(self, body, headers):
        if headers.get(b"content-type") != b"application/json":
            raise RequestError(415, "content-type must be application/json", "unsupported_media_type")
        model = orjson.loads(body).get("model")
        if model != "known":
            raise RequestError(404, f"model {model!r} not found", "not_found")
        raise RequestError(400, "nothing else is accepted", "invalid_request")

    def error_body(self, error):
        return orjson.dumps({"error": {"message": error.message}})


def stub_app(**settings) -> App:
    return App(Settings(embedded_workers=0, **settings), codecs=[LoadedCodec(StubCodec(), "stub", "tests", "0")])


def test_tracing_off_builds_nothing():
    app = stub_app()
    assert app.recorder.tracer is None
    assert app.recorder.trace_output_ids is False
    assert app.stats()["trace"] == {"enabled": False}


def test_output_ids_are_kept_only_for_a_parser():
    assert stub_app(trace_stderr=True).recorder.trace_output_ids is False
    assert stub_app(trace_stderr=True, tokenizer=str(TOKENIZER_PATH)).recorder.trace_output_ids is False
    assert stub_app(trace_stderr=True, tokenizer=str(TOKENIZER_PATH), reasoning_parser="qwen3").recorder.trace_output_ids


async def request(app: App, method: str, path: str, body: bytes, headers: list) -> int:
    pending = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict] = []

    async def receive():
        if pending:
            return pending.pop()
        await anyio.sleep_forever()

    async def send(message):
        sent.append(message)

    await app({"type": "http", "method": method, "path": path, "headers": headers}, receive, send)
    return sent[0]["status"]


async def test_rejections_on_a_matched_route_leave_one_record_each(tmp_path):
    app = stub_app(trace_file=str(tmp_path / "t.jsonl"))
    to_app, app_in = anyio.create_memory_object_stream(4)
    app_out, from_app = anyio.create_memory_object_stream(4)
    json_ct = [(b"content-type", b"application/json")]
    async with anyio.create_task_group() as tg:
        tg.start_soon(app, {"type": "lifespan"}, app_in.receive, app_out.send)
        await to_app.send({"type": "lifespan.startup"})
        assert (await from_app.receive())["type"] == "lifespan.startup.complete"
        assert await request(app, "POST", "/stub/generate", b"{}", []) == 415
        assert await request(app, "POST", "/stub/generate", b'{"model": "m"}', json_ct) == 404
        assert await request(app, "POST", "/stub/generate", b'{"model": "known"}',
                             json_ct + [(b"x-session-id", b"s1")]) == 400
        assert await request(app, "GET", "/stub/generate", b"", []) == 405
        assert await request(app, "POST", "/nowhere", b"{}", []) == 404  # no route: no record
        await to_app.send({"type": "lifespan.shutdown"})
        assert (await from_app.receive())["type"] == "lifespan.shutdown.complete"
    recs = lines(tmp_path.iterdir())
    assert [(r["method"], r["route"], r["status"], r["http_status"], r["error"]["type"]) for r in recs] == [
        ("POST", "/stub/generate", "rejected", 415, "unsupported_media_type"),
        ("POST", "/stub/generate", "rejected", 404, "not_found"),
        ("POST", "/stub/generate", "rejected", 400, "invalid_request"),
        ("GET", "/stub/generate", "rejected", 405, "method_not_allowed"),
    ]
    assert [r.get("session") for r in recs] == [None, None, {"session_id": "s1"}, None]
    assert {r["format"] for r in recs} == {"stub"}
    assert app.stats()["trace"]["records"] == 4


async def test_an_unwritable_trace_file_fails_startup(tmp_path):
    app = stub_app(trace_file=str(tmp_path / "missing-dir" / "t.jsonl"))
    to_app, app_in = anyio.create_memory_object_stream(4)
    app_out, from_app = anyio.create_memory_object_stream(4)
    async with anyio.create_task_group() as tg:
        tg.start_soon(app, {"type": "lifespan"}, app_in.receive, app_out.send)
        await to_app.send({"type": "lifespan.startup"})
        message = await from_app.receive()
    assert message["type"] == "lifespan.startup.failed"
    assert "No such file or directory" in message["message"]
