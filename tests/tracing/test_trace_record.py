"""Building request-end records from RequestState: exact layout, optional
fields, session and replay context, the schema and its published copy, the
validator, and property tests of the accounting laws."""

from __future__ import annotations

import math
import pathlib

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from asgi_generate.tracing.state import RequestState
from asgi_generate.assets import TOKENIZER_PATH
from asgi_generate.request.state import fail
from asgi_generate.tracing.state import LegRecord as Attempt
from asgi_generate.tracing.analysis import OutputAnalyzer
from asgi_generate.tracing.hashing import block_hashes
from asgi_generate.tracing.record import _ms, build_record, session_fields
from asgi_generate.tracing.schema import ATTEMPT_OUTCOMES, STATUSES, schema_json
from asgi_generate.tracing.offline.validate import check_records, read_jsonl

ROOT = pathlib.Path(__file__).resolve().parents[2]
ANALYZER = OutputAnalyzer(str(TOKENIZER_PATH), "qwen3", "hermes")
RID = "0123456789abcdef0000000000000001"


def built(s: RequestState, bs: int, analyzer: OutputAnalyzer | None = None) -> dict:
    """The record of ``s`` as the sinks get it: its JSON text, parsed."""
    return orjson.loads(orjson.dumps(build_record(s, bs, analyzer)))


def valid(*records: dict) -> None:
    """Every record passes the schema and the accounting laws."""
    count, problems = check_records((f"r{i}", r) for i, r in enumerate(records))
    assert (count, problems) == (len(records), [])


def state(**kw) -> RequestState:
    base = dict(request_id=RID, format="sglang", route="/generate", method="POST",
                received_unix_ms=1_700_000_000_000, t_received=100.0)
    base.update(kw)
    return RequestState(**base)


def finished_ok() -> RequestState:
    s = state(public_id="call-42", stream=True, input_ids=list(range(10, 140)), input_length=130,
              headers={b"x-session-id": b"run42:res", b"x-parent-session-id": b"run42:plan",
                       b"x-request-id": b"hdr-7"},
              status="ok", http_status=200, finish_reason="stop", output_tokens=5,
              engine_completion_tokens=5, prompt_tokens=130, cached_tokens=64,
              t_dispatched=100.0005, t_first_token=100.0825, t_last_token=100.0905, t_done=101.0001)
    s.attempts.append(Attempt("0123456789abcdef0000000000000002", "aggregated", "w1", outcome="finished"))
    return s


def test_exact_record():
    rec = built(finished_ok(), 64)
    assert rec == {
        "schema": "asgi_generate.request_trace.v1",
        "event_type": "request_end",
        "event_time_unix_ms": 1_700_000_001_000,
        "request_id": RID,
        "public_id": "call-42",
        "x_request_id": "hdr-7",
        "format": "sglang",
        "route": "/generate",
        "method": "POST",
        "stream": True,
        "status": "ok",
        "http_status": 200,
        "input_tokens": 130,
        "output_tokens": 5,
        "cached_tokens": 64,
        "received_unix_ms": 1_700_000_000_000,
        "dispatch_wait_ms": 0.5,
        "ttft_ms": 82.5,
        "total_ms": 1000.1,
        "mean_itl_ms": 2.0,
        "attempts": [{"engine_id": "0123456789abcdef0000000000000002", "worker_id": "w1",
                      "role": "aggregated", "outcome": "finished"}],
        "finish": {"finish_reason": "stop", "backend_finish_reason": "stop"},
        "session": {"session_id": "run42:res", "parent_session_id": "run42:plan"},
        "replay": {"block_size": 64, "input_length": 130, "block_hashes": block_hashes(list(range(10, 140)), 64)},
    }
    assert len(rec["replay"]["block_hashes"]) == 3
    valid(rec)


def test_the_block_hashes_text_is_what_orjson_makes_of_the_list():
    # The writer serializes the hashes in C (an orjson.Fragment): the line
    # must be byte for byte the one orjson writes for the list of ints.
    rec = build_record(finished_ok(), 64)
    assert type(rec["replay"]["block_hashes"]) is orjson.Fragment
    listed = {**rec, "replay": {**rec["replay"], "block_hashes": block_hashes(list(range(10, 140)), 64)}}
    assert orjson.dumps(rec) == orjson.dumps(listed)
    assert orjson.loads(orjson.dumps(rec)) == listed  # u64 hashes survive JSON


# Durations in seconds as the handler measures them, ties of the third
# decimal of a millisecond (exact and one float off either side), and any float.
durations = st.one_of(
    st.floats(0, 100),
    st.integers(0, 10**9).map(lambda us: us / 1e6),
    st.integers(0, 10**9).map(lambda us: (us + 0.5) / 1e6),
    st.builds(lambda us, k: math.nextafter((us + 0.5) / 1e6, k), st.integers(0, 10**9), st.sampled_from([0, 1])),
    st.floats(allow_nan=True, allow_infinity=True),
)


@settings(max_examples=2000, deadline=None)
@given(durations)
def test_milliseconds_are_round_to_three_decimals_exactly(seconds):
    expected = round(seconds * 1000.0, 3)
    got = _ms(seconds)
    assert repr(got) == repr(expected)  # -0.0 and nan included


def test_minimal_record_has_no_empty_fields():
    s = state(status="client_disconnect", t_done=100.25)
    assert built(s, 64) == {
        "schema": "asgi_generate.request_trace.v1",
        "event_type": "request_end",
        "event_time_unix_ms": 1_700_000_000_250,
        "request_id": RID,
        "format": "sglang",
        "route": "/generate",
        "method": "POST",
        "status": "client_disconnect",
        "output_tokens": 0,
        "received_unix_ms": 1_700_000_000_000,
        "total_ms": 250.0,
        "attempts": [],
        "replay": {"excluded": "not_decoded"},
    }
    valid(built(s, 64))


def test_matched_stop_is_kept_and_a_long_stop_string_cut():
    s = finished_ok()
    s.finish_matched = 2
    assert built(s, 64)["finish"] == {"finish_reason": "stop", "backend_finish_reason": "stop", "matched": 2}
    s.finish_matched = "x" * 300
    rec = built(s, 64)
    assert rec["finish"]["matched"] == "x" * 256
    valid(rec)


def test_engine_completion_tokens_only_when_they_differ():
    s = finished_ok()
    s.engine_completion_tokens = 7
    assert built(s, 64)["engine_completion_tokens"] == 7
    s.engine_completion_tokens = 5
    assert "engine_completion_tokens" not in built(s, 64)


def test_input_tokens_fall_back_to_the_engine_prompt_tokens_for_text():
    s = finished_ok()
    s.input_ids, s.input_length, s.replay_excluded = None, None, "text"
    rec = built(s, 64)
    assert (rec["input_tokens"], rec["replay"]) == (130, {"excluded": "text"})
    valid(rec)


def test_replay_exclusions():
    assert built(state(status="ok", t_done=101.0, replay_excluded="multimodal"), 64)["replay"] == {
        "excluded": "multimodal"
    }
    big = state(status="rejected", t_done=101.0, input_ids=[1, 2**32], input_length=2)
    assert built(big, 64)["replay"] == {"excluded": "token_id_out_of_range"}
    empty = state(status="rejected", t_done=101.0, input_ids=[], input_length=0)
    assert built(empty, 4)["replay"] == {"block_size": 4, "input_length": 0, "block_hashes": []}


def test_session_fields_only_for_headers_sent():
    assert session_fields({}) is None
    assert session_fields({b"x-session-final": b"TRUE"}) == {"session_final": True}
    assert session_fields({b"x-session-final": b"0"}) == {"session_final": False}
    assert session_fields({b"x-session-id": b"", b"x-session-final": b" yes "}) == {
        "session_id": "", "session_final": True
    }
    assert session_fields({b"x-session-id": b"s" * 300}) == {"session_id": "s" * 256}


def test_client_ids_are_cut_and_errors_bounded():
    s = state(public_id="p" * 1000, headers={b"x-request-id": b"\xff" * 3}, t_done=100.5)
    fail(s, "rejected", 400, "invalid_request", "m" * 5000)
    rec = built(s, 64)
    assert rec["public_id"] == "p" * 256
    assert rec["x_request_id"] == "\ufffd" * 3
    assert rec["error"] == {"type": "invalid_request", "message": "m" * 1024}
    valid(rec)


def test_tool_calls_rewrite_a_natural_stop():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
    ids = ANALYZER.tokenizer.encode(text, add_special_tokens=False).ids
    s = finished_ok()
    s.output_ids, s.output_tokens, s.engine_completion_tokens = ids, len(ids), len(ids)
    rec = built(s, 64, ANALYZER)
    assert rec["finish"] == {"finish_reason": "tool_calls", "backend_finish_reason": "stop",
                             "tool_calls": [{"index": 0, "name": "get_weather"}]}
    assert rec["reasoning_tokens"] == 0
    valid(rec)
    s.finish_reason = "length"
    assert built(s, 64, ANALYZER)["finish"] == {
        "finish_reason": "length", "backend_finish_reason": "length",
        "tool_calls": [{"index": 0, "name": "get_weather"}],
    }
    s.finish_reason, s.status = None, "client_disconnect"
    rec = built(s, 64, ANALYZER)
    assert "finish" not in rec
    valid(rec)


def test_only_delivered_output_is_parsed():
    ids = ANALYZER.tokenizer.encode("<think>\nhmm\n</think>\n\nok", add_special_tokens=False).ids
    s = finished_ok()
    # A unary answer cut short: the engine sent tokens, the client got none.
    s.output_ids, s.output_tokens, s.status, s.finish_reason = ids, 0, "client_disconnect", None
    s.engine_completion_tokens = len(ids)
    assert built(s, 64, ANALYZER)["reasoning_tokens"] == 0
    s.output_tokens = 3
    assert built(s, 64, ANALYZER)["reasoning_tokens"] == 3


def test_published_schema_file_is_current():
    assert (ROOT / "trace" / "request_trace.v1.schema.json").read_bytes() == schema_json()


def test_example_records_are_valid():
    examples = sorted((ROOT / "trace" / "examples").glob("*.jsonl"))
    assert examples
    for path in examples:
        count, problems = check_records(read_jsonl(str(path)))
        assert problems == []
        assert count > 0


def test_validator_reports_each_violation():
    good = built(finished_ok(), 64)
    bad_hashes = {**good, "request_id": "f" * 32, "replay": {**good["replay"], "block_hashes": [1]}}
    too_much_reasoning = {**good, "request_id": "e" * 32, "reasoning_tokens": 6}
    wrong_finish = {**good, "request_id": "d" * 32,
                    "finish": {"finish_reason": "stop", "backend_finish_reason": "stop",
                               "tool_calls": [{"index": 0, "name": "f"}]}}
    missing = {k: v for k, v in good.items() if k != "status"}
    count, problems = check_records([
        ("a:1", good), ("a:2", good), ("a:3", bad_hashes), ("a:4", too_much_reasoning),
        ("a:5", wrong_finish), ("a:6", missing), ("a:7", ValueError("not JSON: x")),
    ])
    assert count == 7
    assert problems == [
        f"a:2: request_id {RID} already used at a:1",
        "a:3: 1 block hashes for input_length 130 at block_size 64",
        "a:4: reasoning_tokens 6 > output_tokens 5",
        "a:5: finish_reason 'stop' should be 'tool_calls' (backend 'stop', 1 tool calls)",
        "a:6: schema: .: 'status' is a required property",
        "a:7: not JSON: x",
    ]


# -- properties ---------------------------------------------------------------

OUTPUT_IDS = st.lists(st.sampled_from([3, 4, 5, 6, 2, 205, 1732, 400]), max_size=40)


@st.composite
def request_states(draw) -> RequestState:
    t0 = draw(st.floats(0, 1e6, allow_nan=False))
    offsets = sorted(draw(st.lists(st.floats(0, 100, allow_nan=False), min_size=4, max_size=4)))
    out_ids = draw(OUTPUT_IDS)
    delivered = draw(st.integers(0, len(out_ids)))
    status = draw(st.sampled_from(STATUSES))
    finish = (draw(st.sampled_from(["stop", "length", "abort"])) if status == "ok" else "abort"
              if status == "engine_abort" else draw(st.sampled_from([None, "stop", "length", "abort"])))
    input_ids = draw(st.one_of(st.none(), st.lists(st.integers(0, 2**32 - 1), max_size=200)))
    s = state(
        t_received=t0,
        received_unix_ms=draw(st.integers(0, 2**41)),
        status=status,
        http_status=draw(st.sampled_from([200, 400, 502])) if status == "ok" or draw(st.booleans()) else None,
        stream=draw(st.one_of(st.none(), st.booleans())),
        input_ids=input_ids,
        input_length=None if input_ids is None else len(input_ids),
        replay_excluded=None if input_ids is not None else draw(st.sampled_from([None, "text", "multimodal"])),
        output_ids=out_ids,
        output_tokens=delivered,
        engine_completion_tokens=draw(st.one_of(st.none(), st.integers(0, 50))),
        cached_tokens=draw(st.one_of(st.none(), st.integers(0, 50))),
        finish_reason=finish,
        t_dispatched=t0 + offsets[0],
        t_first_token=t0 + offsets[1] if delivered else None,
        t_last_token=t0 + offsets[2] if delivered else None,
        t_done=t0 + offsets[3],
        headers=draw(st.dictionaries(st.sampled_from([b"x-session-id", b"x-session-final", b"x-other"]),
                                     st.binary(max_size=8))),
    )
    for i in range(draw(st.integers(1 if delivered else 0, 3))):
        s.attempts.append(Attempt(f"{i:032x}", "aggregated", f"w{i}",
                                  outcome=draw(st.sampled_from(ATTEMPT_OUTCOMES)),
                                  abort_acked=draw(st.one_of(st.none(), st.booleans()))))
    return s


@settings(max_examples=300, deadline=None)
@given(request_states(), st.integers(1, 80))
def test_accounting_laws(s, bs):
    rec = built(s, bs, ANALYZER)
    valid(rec)
    assert rec["output_tokens"] == s.output_tokens
    assert 0 <= rec["reasoning_tokens"] <= rec["output_tokens"]
    assert ("engine_completion_tokens" in rec) == (
        s.engine_completion_tokens is not None and s.engine_completion_tokens != s.output_tokens)
    if s.input_ids is not None:
        assert rec["input_tokens"] == rec["replay"]["input_length"] == len(s.input_ids)
        assert len(rec["replay"]["block_hashes"]) == math.ceil(len(s.input_ids) / bs)
    else:
        assert rec["replay"] == {"excluded": s.replay_excluded or "not_decoded"}
    assert len(rec["attempts"]) == len(s.attempts)
    assert ("session" in rec) == any(k in s.headers for k in (b"x-session-id", b"x-session-final"))
    if s.finish_reason is None:
        assert "finish" not in rec
    else:
        names = rec["finish"]["tool_calls"]
        rewritten = s.finish_reason == "stop" and bool(names)
        assert rec["finish"]["finish_reason"] == ("tool_calls" if rewritten else s.finish_reason)


@st.composite
def legs_with_versions(draw) -> tuple[list[Attempt], list]:
    """Legs of one request as its engines reported their weight versions:
    per token (SGLang chunks), as spans over the leg's whole output at its
    end (vLLM), or not at all (the worker's reading at the leg's start
    stands for them); some legs deliver fewer tokens than their engine made
    (a codec's cut). Returns the legs and the version of every token sent,
    in order."""
    from asgi_generate.sdk import Event

    versions = st.sampled_from(["default", "1", "2"])
    legs, truth = [], []
    for i in range(draw(st.integers(1, 4))):
        made = draw(st.lists(versions, max_size=12))
        sent = draw(st.integers(0, len(made)))
        reading = draw(st.none() | versions)
        style = draw(st.sampled_from(["chunks", "spans", "none"]))
        leg = Attempt(f"e{i}", "resumed" if i else "aggregated", f"w{i}",
                      {} if reading is None else {"weight_version": reading})
        for j in range(sent):
            leg.count(Event([7], weight_version=made[j] if style == "chunks" else None))
        if style == "spans":
            starts = [j for j in range(len(made)) if j == 0 or made[j] != made[j - 1]]
            ends = starts[1:] + [len(made)]
            leg.count(Event([], "length", weight_spans=[(made[s], s, e) for s, e in zip(starts, ends)]))
        legs.append(leg)
        truth += made[:sent] if style != "none" else [reading] * sent
    return legs, truth


@given(legs_with_versions())
def test_law_segments_are_the_engines_versions_of_the_tokens_sent(drawn):
    legs, truth = drawn
    s = state(status="ok", stream=True, t_done=101.0, output_tokens=len(truth), attempts=legs, pause_resumes=1,
              migrations=len(legs) - 1, finish_reason="length", http_status=200)
    rec = built(s, 16)
    expected: list[dict] = []
    for v in truth:
        if expected and expected[-1]["weight_version"] == v:
            expected[-1]["tokens"] += 1
        else:
            expected.append({"weight_version": v, "tokens": 1})
    assert rec["segments"] == expected
    assert sum(x["tokens"] for x in rec["segments"]) == rec["output_tokens"] == len(truth)
    valid(rec)
