"""``asgi-generate-trace``: validate, summarize, export-mooncake, schema."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import orjson
import pytest

from asgi_generate.tracing.schema import schema_json
from asgi_generate.tracing.offline.rows import percentile
from asgi_generate.tracing.offline.tools import main

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "trace" / "examples" / "request_trace.v1.jsonl"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_validate_passes_the_examples(capsys):
    assert run(capsys, "validate", str(EXAMPLES)) == (0, "VALID: 9 records\n", "")


def test_validate_reports_violations_and_fails(capsys, tmp_path):
    recs = [orjson.loads(x) for x in EXAMPLES.read_bytes().splitlines()]
    recs[1]["request_id"] = recs[0]["request_id"]
    recs[2]["output_tokens"] = -1
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"\n".join(orjson.dumps(r) for r in recs[:3]) + b"\n{oops\n")
    code, out, _ = run(capsys, "validate", str(bad))
    assert code == 1
    rid = recs[0]["request_id"]
    printed = out.splitlines()
    assert printed[:2] + printed[3:] == [
        f"{bad}:2: request_id {rid} already used at {bad}:1",
        f"{bad}:3: schema: output_tokens: -1 is less than the minimum of 0",
        "INVALID: 3 violations in 4 records",
    ]
    assert printed[2].startswith(f"{bad}:4: not JSON: unexpected character")  # orjson's wording


def test_an_engine_abort_record_needs_the_engines_abort_finish(capsys, tmp_path):
    (rec,) = [orjson.loads(x) for x in EXAMPLES.read_bytes().splitlines() if b'"engine_abort"' in x]
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(orjson.dumps({**rec, "finish": {"finish_reason": "length", "backend_finish_reason": "length"}})
                    + b"\n" + orjson.dumps({k: v for k, v in rec.items() if k not in ("finish", "request_id")}
                                           | {"request_id": "f" * 32}) + b"\n")
    code, out, _ = run(capsys, "validate", str(bad))
    assert (code, out.splitlines()) == (1, [
        f"{bad}:1: status engine_abort without the engine's abort finish",
        f"{bad}:2: status engine_abort without the engine's abort finish",
        "INVALID: 2 violations in 2 records",
    ])


def test_ids_must_be_unique_across_files(capsys, tmp_path):
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(EXAMPLES.read_bytes()[: EXAMPLES.read_bytes().index(b"\n") + 1])
    code, out, _ = run(capsys, "validate", str(EXAMPLES), str(copy))
    assert code == 1
    assert out.splitlines()[-1] == "INVALID: 1 violations in 10 records"


def test_unreadable_file(capsys, tmp_path):
    code, _, err = run(capsys, "validate", str(tmp_path / "none.jsonl"))
    assert code == 2
    assert "No such file or directory" in err


def test_summarize(capsys):
    code, out, _ = run(capsys, "summarize", str(EXAMPLES))
    assert code == 0
    assert out == """\
requests: 9
by status:
  ok                              4
  rejected                        2
  client_disconnect               1
  engine_abort                    1
  engine_error                    1
by format:
  sglang                          7
  vllm                            2
by finish reason:
  (none)                          4
  stop                            2
  abort                           1
  length                          1
  tool_calls                      1
tokens:
  input_tokens                  636
  output_tokens                 140
  cached_tokens                 528
  reasoning_tokens               40
latency ms             n        p50        p90        p99        max
  ttft_ms              7       12.0       30.1       30.1       30.1
  total_ms             9       31.0      128.1      128.1      128.1
"""


def test_percentile_is_nearest_rank():
    values = [5, 1, 4, 2, 3]
    assert [percentile(values, p) for p in (1, 20, 21, 50, 90, 100)] == [1, 1, 2, 3, 5, 5]


def test_export_mooncake(capsys):
    code, out, err = run(capsys, "export-mooncake", str(EXAMPLES))
    assert code == 0
    assert [orjson.loads(x) for x in out.splitlines()] == [
        {"timestamp": 0, "input_length": 131, "output_length": 49, "hash_ids": [0, 1, 2], "block_size": 64},
        {"timestamp": 1500, "input_length": 191, "output_length": 40, "hash_ids": [0, 1, 3], "block_size": 64},
        {"timestamp": 2000, "input_length": 128, "output_length": 16, "hash_ids": [0, 1], "block_size": 64},
        {"timestamp": 2500, "input_length": 130, "output_length": 7, "hash_ids": [0, 1, 4], "block_size": 64},
        {"timestamp": 4000, "input_length": 3, "output_length": 4, "hash_ids": [5], "block_size": 64},
        {"timestamp": 5000, "input_length": 40, "output_length": 21, "hash_ids": [6], "block_size": 64},
        {"timestamp": 6000, "input_length": 1, "output_length": 0, "hash_ids": [7], "block_size": 64},
    ]
    assert err == "exported 7 requests (block_size 64), skipped 2 without block hashes or engine attempts\n"


def test_export_refuses_mixed_block_sizes(capsys, tmp_path):
    recs = [orjson.loads(x) for x in EXAMPLES.read_bytes().splitlines()]
    recs[0]["replay"]["block_size"] = 16
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_bytes(b"\n".join(orjson.dumps(r) for r in recs))
    code, out, err = run(capsys, "export-mooncake", str(mixed))
    assert (code, out) == (1, "")
    assert err == "asgi-generate-trace: records use several block sizes [16, 64]; export them separately\n"


@pytest.mark.e2e
def test_console_script_prints_the_schema():
    out = subprocess.run([sys.executable, "-m", "asgi_generate.tracing.offline.tools", "schema"],
                         capture_output=True, check=True, timeout=30).stdout
    assert out == schema_json()


def test_an_ok_records_segments_must_sum_to_its_output_tokens(capsys, tmp_path):
    rec = next(orjson.loads(x) for x in EXAMPLES.read_bytes().splitlines() if b'"status":"ok"' in x)
    n = rec["output_tokens"]
    good = {**rec, "segments": [{"weight_version": "default", "tokens": n - 1}, {"weight_version": "1", "tokens": 1}]}
    bad = {**good, "request_id": "e" * 32, "segments": [{"weight_version": "default", "tokens": n + 1}]}
    path = tmp_path / "segments.jsonl"
    path.write_bytes(orjson.dumps(good) + b"\n" + orjson.dumps(bad) + b"\n")
    code, out, _ = run(capsys, "validate", str(path))
    assert (code, out.splitlines()) == (1, [
        f"{path}:2: segments' tokens do not sum to output_tokens",
        "INVALID: 1 violations in 2 records",
    ])
