"""Refusals at start-up, in process: a bad flag, setting or variable of
``asgi-generate serve`` or ``sim`` is one line on stderr and exit status 2,
before anything starts (no process: the suite's guard fails a unit test
that starts one; no thread left behind). tests/e2e/test_cli.py runs the
console entry itself on one of each."""

from __future__ import annotations

import pathlib
import threading

import pytest

from asgi_generate.server.cli import main

TOKENIZER = str(pathlib.Path(__file__).parents[2] / "asgi_generate" / "assets" / "tokenizer.json")


def _run(argv: list[str], capfd) -> tuple[int, str, str]:
    """``asgi-generate ARGV`` in process: its exit status, stderr, stdout."""
    threads = threading.active_count()
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's refusals
        code = exc.code
    out, err = capfd.readouterr()
    assert threading.active_count() == threads
    return code, err, out




@pytest.mark.parametrize("args,env,line", [
    (["--max-body-bytes", "-5"], {},
     "asgi-generate: --max-body-bytes (ASGI_GENERATE_MAX_BODY_BYTES) must be above 0, not -5"),
    (["--health-timeout", "nan"], {},
     "asgi-generate: --health-timeout (ASGI_GENERATE_HEALTH_TIMEOUT) must be above 0, not nan"),
    (["--read-timeout", "-1"], {},
     "asgi-generate: --inter-token-timeout (ASGI_GENERATE_INTER_TOKEN_TIMEOUT) must be 0 or more, not -1.0"),
    (["--trace-rotate-bytes", "-1"], {},
     "asgi-generate: --trace-rotate-bytes (ASGI_GENERATE_TRACE_ROTATE_BYTES) must be 0 or more, not -1"),
    (["--port", "70000"], {},
     "asgi-generate serve: error: argument --port: must be between 0 and 65535, not 70000 (see --help)"),
    (["--workers", "0"], {},
     "asgi-generate serve: error: argument --workers: must be 1 or more, not 0 (see --help)"),
    (["--log-level", "loud"], {},
     "asgi-generate serve: error: argument --log-level: invalid choice: 'loud' (choose from 'debug', "
     "'info', 'warning', 'error', 'critical') (see --help)"),
    (["--trace-file", "{tmp}/missing/t.jsonl"], {},
     "asgi-generate: --trace-file (ASGI_GENERATE_TRACE_FILE): folder '{tmp}/missing' does not exist"),
    (["--tokenizer", "{tmp}/nope.json", "--reasoning-parser", "qwen3", "--trace-stderr"], {},
     "asgi-generate: --tokenizer: cannot load '{tmp}/nope.json': No such file or directory (os error 2)"),
    (["--tokenizer", TOKENIZER, "--reasoning-parser", "qwen3"], {},
     "asgi-generate: --reasoning-parser and --tool-call-parser only annotate trace records: give "
     "--trace-file, --trace-stderr or --otlp-endpoint"),
    (["--trace-otlp"], {}, "asgi-generate: --trace-otlp exports records to the --otlp-endpoint collector: give one"),
    (["--otlp-endpoint", "collector:4318"], {},
     "asgi-generate: --otlp-endpoint (ASGI_GENERATE_OTLP_ENDPOINT) must be an http(s)://HOST[:PORT] URL, not "
     "'collector:4318'"),
    ([], {"PROMETHEUS_MULTIPROC_DIR": "{tmp}/missing"},
     "asgi-generate: PROMETHEUS_MULTIPROC_DIR='{tmp}/missing' is not a folder"),
    ([], {"ASGI_GENERATE_READ_TIMEOUT": "soon"}, "asgi-generate: ASGI_GENERATE_READ_TIMEOUT='soon' is not a number"),
    ([], {"ASGI_GENERATE_TRACE_STDERR": "maybe"},
     "asgi-generate: ASGI_GENERATE_TRACE_STDERR='maybe' is not a boolean (1/0, true/false, yes/no, on/off)"),
    ([], {"ASGI_GENERATE_EMBEDDED_WORKERS": "0"},
     "asgi-generate: --embedded-workers (ASGI_GENERATE_EMBEDDED_WORKERS) must be above 0, not 0"),
])
def test_a_bad_start_is_one_line_and_exit_2_before_anything_starts(tmp_path, monkeypatch, capfd, args, env, line):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    for k, v in env.items():
        monkeypatch.setenv(k, v.replace("{tmp}", str(tmp_path)))
    assert _run(["serve", "--port", "0", *args], capfd) == (2, line.replace("{tmp}", str(tmp_path)) + "\n", "")


@pytest.mark.parametrize("args,line", [
    (["--stream-interval", "0"], "argument --stream-interval: must be 1 or more, not 0"),
    (["--abort-after", "-1"], "argument --abort-after: must be 0 or more, not -1"),
    (["--abort-status", "1000"], "argument --abort-status: must be between 100 and 599, not 1000"),
    (["--itl-ms", "soon"], "argument --itl-ms: 'soon' is not a number"),
    (["--protocol", "tgi"], "argument --protocol: invalid choice: 'tgi' (choose from 'sglang', 'vllm')"),
])
def test_a_bad_sim_flag_is_one_line(capfd, args, line):
    assert _run(["sim", "--port", "0", *args], capfd) == (2, f"asgi-generate sim: error: {line} (see --help)\n", "")


@pytest.mark.parametrize("variable,hint", [
    ("ASGI_GENERATE_WORKER", "did you mean ASGI_GENERATE_WORKERS?"),
    ("ASGI_GENERATE_TRACE_QUEUE", "did you mean ASGI_GENERATE_TRACE_QUEUE_SIZE?"),
    ("ASGI_GENERATE_READTIMEOUT", "did you mean ASGI_GENERATE_READ_TIMEOUT?"),
    ("ASGI_GENERATE_ZZZ", "no setting has a name like it"),
])
def test_an_unknown_variable_is_refused_suggesting_the_nearest_name(monkeypatch, capfd, variable, hint):
    monkeypatch.setenv(variable, "sglang=http://h:1")
    assert _run(["serve", "--port", "0"], capfd) == (
        2, f"asgi-generate: unknown variable {variable}: {hint} (asgi-generate serve --help lists the settings)\n", "")
