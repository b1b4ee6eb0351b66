"""Checks of request-end records beyond what a JSON Schema can say.

:func:`check_records` applies the v1 schema (:mod:`.schema`, with the
``jsonschema`` library) and then the accounting laws every record must keep:
unique internal ids, consistent counts, timings and finish metadata. Used by
``asgi-generate-trace validate`` and by the tests on every record they make.
"""

from __future__ import annotations

import math
from typing import Iterable, Iterator

import jsonschema
import orjson

from ..schema import SCHEMA

_VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)


def read_jsonl(path: str) -> Iterator[tuple[str, object]]:
    """``(where, record)`` for each non-empty line of ``path``; ``where`` is
    ``path:line``. A line that is not JSON yields a ``ValueError`` as its
    record, for the checks to report.

    Raises:
        OSError: the file cannot be read.
    """
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield f"{path}:{n}", orjson.loads(line)
                except orjson.JSONDecodeError as exc:
                    yield f"{path}:{n}", ValueError(f"not JSON: {exc}")


def record_problems(rec: dict) -> list[str]:
    """The accounting laws ``rec`` breaks (assumes it passed the schema)."""
    problems = []
    out = rec["output_tokens"]
    if rec.get("reasoning_tokens", 0) > out:
        problems.append(f"reasoning_tokens {rec['reasoning_tokens']} > output_tokens {out}")
    if rec.get("engine_completion_tokens") == out:
        problems.append("engine_completion_tokens is present but equals output_tokens")
    if out and not rec["attempts"]:
        problems.append(f"output_tokens {out} without any engine attempt")
    if "mean_itl_ms" in rec and out < 2:
        problems.append("mean_itl_ms with fewer than 2 output tokens")
    total = rec["total_ms"]
    for key in ("dispatch_wait_ms", "ttft_ms"):
        if rec.get(key, 0) > total:
            problems.append(f"{key} {rec[key]} > total_ms {total}")
    if abs(rec["event_time_unix_ms"] - rec["received_unix_ms"] - total) > 1:
        problems.append("event_time_unix_ms is not received_unix_ms + total_ms")
    replay = rec["replay"]
    if "block_hashes" in replay:
        expected = math.ceil(replay["input_length"] / replay["block_size"])
        if len(replay["block_hashes"]) != expected:
            problems.append(f"{len(replay['block_hashes'])} block hashes for input_length "
                            f"{replay['input_length']} at block_size {replay['block_size']}")
        if rec.get("input_tokens", replay["input_length"]) != replay["input_length"]:
            problems.append(f"input_tokens {rec['input_tokens']} != replay.input_length {replay['input_length']}")
    if rec["status"] == "ok":
        if "finish" not in rec:
            problems.append("status ok without finish metadata")
        if "http_status" not in rec:
            problems.append("status ok without http_status")
    if rec["status"] == "ok" and "segments" in rec and \
            sum(x["tokens"] for x in rec["segments"]) != rec["output_tokens"]:
        problems.append("segments' tokens do not sum to output_tokens")
    if rec["status"] == "engine_abort" and rec.get("finish", {}).get("backend_finish_reason") != "abort":
        problems.append("status engine_abort without the engine's abort finish")
    finish = rec.get("finish")
    if finish is not None:
        backend, final = finish["backend_finish_reason"], finish["finish_reason"]
        calls = finish.get("tool_calls") or []
        expected_final = "tool_calls" if backend == "stop" and calls else backend
        if final != expected_final:
            problems.append(f"finish_reason {final!r} should be {expected_final!r} "
                            f"(backend {backend!r}, {len(calls)} tool calls)")
        if [c["index"] for c in calls] != list(range(len(calls))):
            problems.append("tool_calls indexes are not 0, 1, 2, ...")
    return problems


def check_records(records: Iterable[tuple[str, object]]) -> tuple[int, list[str]]:
    """Check ``(where, record)`` pairs (see :func:`read_jsonl`).

    Returns:
        The number of records and one message per violation, each starting
        with its ``where``; no messages means every record is valid.
    """
    seen: dict[str, str] = {}
    problems: list[str] = []
    count = 0
    for where, rec in records:
        count += 1
        if isinstance(rec, ValueError):
            problems.append(f"{where}: {rec}")
            continue
        errors = sorted(_VALIDATOR.iter_errors(rec), key=lambda e: list(e.absolute_path))
        if errors:
            problems += [f"{where}: schema: {'/'.join(map(str, e.absolute_path)) or '.'}: {e.message}"
                         for e in errors]
            continue
        problems += [f"{where}: {p}" for p in record_problems(rec)]
        first = seen.setdefault(rec["request_id"], where)
        if first != where:
            problems.append(f"{where}: request_id {rec['request_id']} already used at {first}")
    return count, problems
