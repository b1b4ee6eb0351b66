"""``asgi-generate-trace replay``: a recorded campaign replayed against a
traced frontend keeps its request count, lengths and prefix-sharing
structure (the replayed records' block hashes, numbered in order of first
appearance, are the original rows' hash ids)."""

from __future__ import annotations

import subprocess
import sys
import time

import matplotlib.font_manager  # noqa: F401  (see below)
import orjson
import pytest
from hypothesis import given, settings, strategies as hs

from asgi_generate.tracing.hashing import block_hashes
from asgi_generate.tracing.offline.replay import Row, prompt_tokens
from asgi_generate.tracing.offline.tools import mooncake_rows
from support import post, free_port, sse, start_frontend, start_sim, trace_records

# matplotlib builds its font cache on first use, starting fc-list: importing
# its font manager above builds it at collection, where a process may start,
# so that on a fresh machine the report tests (unit tests) start none.
BLOCK = 16
P1 = list(range(500, 540))  # 2 full blocks and 8 tokens
P2 = list(range(700, 724))


def _campaign() -> list[dict]:
    bodies = []
    for i in range(4):  # one shared prefix, suffixes of several lengths
        bodies.append({"input_ids": P1 + [900 + i] * (5 * i + 1), "sampling_params": {"max_new_tokens": 3 + i},
                       "stream": i % 2 == 0})
    for i in range(3):
        bodies.append({"input_ids": P2 + [950 + i] * 10, "sampling_params": {"max_new_tokens": 5}, "stream": True})
    bodies.append({"input_ids": P1, "sampling_params": {"max_new_tokens": 6}})  # the prefix alone
    bodies.append({"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}})  # under one block
    bodies.append({"text": "not replayable", "sampling_params": {"max_new_tokens": 2}})  # no token ids
    return bodies


def _records(tmp_path, name: str) -> list[dict]:
    return trace_records(str(tmp_path / f"{name}.*.jsonl"))


def _renumbered(hash_lists: list[list[int]]) -> list[list[int]]:
    ids: dict[int, int] = {}
    return [[ids.setdefault(h, len(ids)) for h in hashes] for hashes in hash_lists]


def _replay(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asgi_generate.tracing.offline.tools", "replay", *args, "--no-progress"],
                          capture_output=True, text=True, timeout=50)


def _check_replayed(replayed: list[dict], rows: list[Row]) -> None:
    """One ok record per row, named after it, with its lengths, and the
    rows' prefix-sharing structure exactly."""
    by_row = {rec["public_id"]: rec for rec in replayed}
    assert sorted(by_row) == sorted(f"replay-{i}" for i in range(len(rows))) and len(replayed) == len(rows)
    ordered = [by_row[f"replay-{i}"] for i in range(len(rows))]
    assert [r["status"] for r in ordered] == ["ok"] * len(rows)
    assert [r["replay"]["input_length"] for r in ordered] == [row.input_length for row in rows]
    assert [r["output_tokens"] for r in ordered] == [max(1, row.output_length) for row in rows]
    assert _renumbered([r["replay"]["block_hashes"] for r in ordered]) == [row.hash_ids for row in rows]


@pytest.mark.e2e
def test_a_recorded_campaign_replays_with_its_prefix_structure(tmp_path):
    sim = start_sim("sglang")
    try:
        rec = start_frontend([f"sglang={sim.url}"], extra=["--trace-file", str(tmp_path / "a.jsonl"),
                                                            "--trace-block-size", str(BLOCK)])
        try:
            for body in _campaign():
                status = sse(rec.url, body)[0] if body.get("stream") else post(rec.url, body).status_code
                assert status == 200
                time.sleep(0.02)
        finally:
            rec.stop()  # flushes the records
        original = _records(tmp_path, "a")
        exported, skipped, size = mooncake_rows(original)
        rows = [Row(r["timestamp"], r["input_length"], r["output_length"], r["hash_ids"]) for r in exported]
        assert (len(original), len(rows), skipped, size) == (10, 9, 1, BLOCK)
        # The campaign's structure: P1's two full blocks shared by five rows.
        assert [row.hash_ids[:2] for row in rows].count([0, 1]) == 5

        target = start_frontend([f"sglang={sim.url}"], extra=["--trace-file", str(tmp_path / "b.jsonl"),
                                                               "--trace-block-size", str(BLOCK)])
        try:
            files = [str(f) for f in sorted(tmp_path.glob("a.*.jsonl"))]
            done = _replay(*files, "--url", target.url, "--speedup", "2", "--report", str(tmp_path / "r.html"))
        finally:
            target.stop()
    finally:
        sim.stop()
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "sent 9, ok 9, client disconnects 0, errors 0"
    assert [line.split()[:2] for line in lines[3:6]] == [["ttft", "9"], ["itl", str(_gaps(rows))], ["e2e", "9"]]
    # The recording beside the replay: the same requests and tokens.
    tokens = str(sum(row.output_length for row in rows))
    assert lines[6] == "recorded vs replayed    recorded   replayed"
    assert [line.split() for line in lines[7:10]] == [
        ["requests", "ok", "9", "9"], ["client", "disconnects", "0", "0"], ["output", "tokens", tokens, tokens]]
    assert [" ".join(line.split()[:3]) for line in lines[10:]] == [
        "ttft p50 ms", "ttft p99 ms", "e2e p50 ms", "e2e p99 ms", "mean itl p50", "mean itl p99"]
    assert done.stderr.splitlines()[0] == (
        f"replaying 9 requests (block_size {BLOCK}, 1 record skipped) against {target.url}, speedup 2")
    _check_replayed(_records(tmp_path, "b"), rows)
    report = (tmp_path / "r.html").read_text()
    assert report.count('src="data:image/png;base64,') == 3
    assert "sent 9, ok 9, client disconnects 0, errors 0" in report and "recorded vs replayed" in report
    for name, value in (("url", target.url), ("speedup", "2"), ("block size", str(BLOCK)),
                        ("input", "request_end records"), ("requests", "9 (1 records skipped)")):
        assert f"<tr><td>{name}</td><td>{value}</td></tr>" in report
    assert "<h2>Errors</h2><p>none</p>" in report


def _gaps(rows: list[Row]) -> int:
    """ITL samples of the replay: SGLang streams one event per token."""
    return sum(max(1, row.output_length) - 1 for row in rows)


@pytest.mark.e2e
def test_a_mooncake_trace_replays_with_its_block_size(tmp_path):
    rows = [Row(0, 10, 3, [0, 1, 2]), Row(10, 12, 2, [0, 1, 3]), Row(20, 4, 1, [4]), Row(30, 8, 4, [0, 1])]
    path = tmp_path / "mooncake.jsonl"
    path.write_bytes(b"".join(orjson.dumps({"timestamp": r.timestamp, "input_length": r.input_length,
                                            "output_length": r.output_length, "hash_ids": r.hash_ids}) + b"\n"
                              for r in rows))
    sim = start_sim("sglang")
    try:
        target = start_frontend([f"sglang={sim.url}"], extra=["--trace-file", str(tmp_path / "m.jsonl"),
                                                               "--trace-block-size", "4"])
        try:
            done = _replay(str(path), "--url", target.url, "--block-size", "4")
        finally:
            target.stop()
    finally:
        sim.stop()
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "sent 4, ok 4, client disconnects 0, errors 0"
    _check_replayed(_records(tmp_path, "m"), rows)


@pytest.mark.e2e
def test_unreachable_frontend_counts_every_request_as_an_error(tmp_path):
    path = tmp_path / "mooncake.jsonl"
    path.write_text("".join(f'{{"timestamp": {i}, "input_length": 5, "output_length": 2, "hash_ids": [{i}]}}\n'
                            for i in range(3)))
    done = _replay(str(path), "--url", f"http://127.0.0.1:{free_port()}", "--block-size", "512",
                   "--report", str(tmp_path / "r.html"))
    assert done.returncode == 1
    lines = done.stdout.splitlines()
    assert lines[0] == "sent 3, ok 0, client disconnects 0, errors 3"
    assert lines[-2:] == ["errors:", f"  {'connect':<24} {3:>8}"]
    report = (tmp_path / "r.html").read_text()
    assert "<tr><th>kind</th><th>requests</th><th>the first one said</th></tr><tr><td>connect</td><td>3</td>" in report
    assert "<tr><td>input</td><td>Mooncake trace</td></tr>" in report


def _recorded(i: int, hashes: list[int], block_size: int = 16) -> dict:
    """A request_end record with what an export reads."""
    return {"event_type": "request_end", "request_id": f"{i:032x}", "received_unix_ms": 1_700_000_000_000 + 5 * i,
            "output_tokens": 3, "attempts": [{"engine_id": f"{i:032x}", "worker_id": "w0", "role": "aggregated"}],
            "replay": {"block_size": block_size, "input_length": 16 * len(hashes), "block_hashes": hashes}}


@pytest.mark.e2e
def test_an_export_carries_its_block_size_and_replay_uses_it(tmp_path):
    records = tmp_path / "trace.jsonl"
    records.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in (_recorded(0, [11, 12]), _recorded(1, [11, 13]))))
    export = subprocess.run([sys.executable, "-m", "asgi_generate.tracing.offline.tools", "export-mooncake",
                             str(records)], capture_output=True, timeout=30)
    assert export.returncode == 0, export.stderr
    assert [orjson.loads(line) for line in export.stdout.splitlines()] == [
        {"timestamp": 0, "input_length": 32, "output_length": 3, "hash_ids": [0, 1], "block_size": 16},
        {"timestamp": 5, "input_length": 32, "output_length": 3, "hash_ids": [0, 2], "block_size": 16},
    ]
    exported = tmp_path / "mooncake.jsonl"
    exported.write_bytes(export.stdout)
    url = f"http://127.0.0.1:{free_port()}"
    done = _replay(str(exported), "--url", url)
    assert done.stderr.splitlines()[0] == f"replaying 2 requests (block_size 16, 0 records skipped) against {url}, speedup 1"
    done = _replay(str(exported), "--url", url, "--block-size", "512")
    assert (done.returncode, done.stderr) == (
        2, "asgi-generate-trace: --block-size 512 disagrees with the file's block size 16\n")
    bare = tmp_path / "bare.jsonl"
    bare.write_text('{"timestamp": 0, "input_length": 5, "output_length": 2, "hash_ids": [0]}\n')
    done = _replay(str(bare), "--url", url)
    assert (done.returncode, done.stderr) == (2, "asgi-generate-trace: the trace carries no block_size: give "
                                                 "--block-size (the FAST'25 Mooncake traces use 512)\n")


def _write(path, records: list[dict]) -> str:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    return str(path)


def _replay_recorded(tmp_path, records: list[dict], **sim) -> subprocess.CompletedProcess:
    """``records`` replayed through a frontend (its records in ``b.*.jsonl``)
    in front of an SGLang simulator started with ``sim``."""
    path = _write(tmp_path / "recorded.jsonl", records)
    engine = start_sim("sglang", **sim)
    try:
        target = start_frontend([f"sglang={engine.url}"], extra=["--trace-file", str(tmp_path / "b.jsonl")])
        try:
            return _replay(path, "--url", target.url)
        finally:
            target.stop()
    finally:
        engine.stop()


@pytest.mark.e2e
def test_recorded_client_disconnects_are_replayed_as_disconnects(tmp_path):
    # Three requests that ran to their end (3 tokens each), one client that
    # left after 2 streamed tokens and one that left before its first token.
    records = [{**_recorded(i, [11, 12 + i]), "status": "ok", "stream": True, "total_ms": 20.0} for i in range(3)]
    records.append({**_recorded(3, [11, 20]), "status": "client_disconnect", "stream": True, "output_tokens": 2,
                    "total_ms": 15.0})
    records.append({**_recorded(4, [11, 21]), "status": "client_disconnect", "stream": True, "output_tokens": 0,
                    "total_ms": 600_000.0})
    done = _replay_recorded(tmp_path, records)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "sent 5, ok 3, client disconnects 2, errors 0"
    assert [line.split()[:2] for line in lines[3:6]] == [["ttft", "3"], ["itl", "6"], ["e2e", "3"]]
    assert [line.split() for line in lines[7:10]] == [
        ["requests", "ok", "3", "3"], ["client", "disconnects", "2", "2"], ["output", "tokens", "11", "11"]]
    # The engine was asked one token past where each client left.
    replayed = {rec["public_id"]: rec for rec in _records(tmp_path, "b")}
    assert sorted(replayed) == [f"replay-{i}" for i in range(5)]
    assert [replayed[f"replay-{i}"]["replay"]["input_length"] for i in range(5)] == [32] * 5


@pytest.mark.e2e
def test_a_client_that_left_before_its_first_token_leaves_at_its_recorded_time(tmp_path):
    records = [{**_recorded(0, [11, 12]), "status": "client_disconnect", "stream": True, "output_tokens": 0,
                "total_ms": 50.0}]
    done = _replay_recorded(tmp_path, records, ttft_ms=60000)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "sent 1, ok 0, client disconnects 1, errors 0"
    assert [line.split() for line in lines[7:10]] == [
        ["requests", "ok", "0", "0"], ["client", "disconnects", "1", "1"], ["output", "tokens", "0", "0"]]
    [replayed] = _records(tmp_path, "b")
    assert (replayed["public_id"], replayed["status"], replayed["output_tokens"]) == ("replay-0", "client_disconnect", 0)
    assert replayed["attempts"][0]["abort_acked"] is True


def test_the_reports_itl_plot_is_on_a_log_scale_and_errors_are_broken_down(tmp_path, monkeypatch):
    import matplotlib.axes

    from asgi_generate.tracing.offline.replay import Result
    from asgi_generate.tracing.offline.report import write_report

    scales = []
    set_xscale = matplotlib.axes.Axes.set_xscale
    monkeypatch.setattr(matplotlib.axes.Axes, "set_xscale",
                        lambda self, value, **kw: (scales.append(value), set_xscale(self, value, **kw))[1])
    ok = Result(0, 0.0, start=0.0, ttft=0.01, e2e=0.6, output_tokens=3, events=[(0.01, 1), (0.0102, 2), (0.6, 3)])
    failed = Result(1, 0.1, error="http 503", detail='{"error": {"message": "busy"}}')
    path = tmp_path / "r.html"
    assert write_report(str(path), "t", [("url", "http://x"), ("speedup", "4")], "summary", [ok, failed]) == 3
    assert scales == ["log"]
    report = path.read_text()
    assert "<tr><td>url</td><td>http://x</td></tr><tr><td>speedup</td><td>4</td></tr>" in report
    assert ("<tr><td>http 503</td><td>1</td><td>{&quot;error&quot;: {&quot;message&quot;: &quot;busy&quot;}}"
            "</td></tr>") in report


@pytest.mark.e2e
def test_bad_input_is_one_line(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"timestamp": 0}\n')
    done = _replay(str(path), "--url", "http://127.0.0.1:1")
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (f"asgi-generate-trace: {path}:1: neither a request_end record nor a Mooncake row "
                           "(timestamp, input_length, output_length, hash_ids)\n")


@settings(max_examples=25, deadline=None)
@given(hs.lists(hs.lists(hs.integers(0, 2), min_size=1, max_size=5), min_size=1, max_size=8),
       hs.integers(1, 8))
def test_synthesized_prompts_share_exactly_the_prefixes_their_hash_ids_share(paths, block_size):
    # Each row is a path down a tree of blocks; a node's id stands for its
    # whole prefix, as chained block hashes do.
    nodes: dict[tuple, int] = {}
    rows = [Row(0, len(p) * block_size, 1, [nodes.setdefault(tuple(p[:k + 1]), len(nodes)) for k in range(len(p))])
            for p in paths]
    hashed = [block_hashes(prompt_tokens(row, block_size, 4096), block_size) for row in rows]
    assert _renumbered(hashed) == _renumbered([row.hash_ids for row in rows])
    assert all(100 <= t < 4096 for row in rows for t in prompt_tokens(row, block_size, 4096))
