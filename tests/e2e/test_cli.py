"""The command line: the embedded default, several processes, --help."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import socket
import subprocess
import sys

import httpx
import orjson
import pytest

import asgi_generate
from asgi_generate import hashes
from asgi_generate.server.serving import WORKER_CLASSES
from support import (Proc, RawClient, children, free_port, listening_socket, post, start_frontend, start_sim,
                     wait_until)

pytestmark = pytest.mark.e2e

TOKENIZER = str(pathlib.Path(__file__).parents[2] / "asgi_generate" / "assets" / "tokenizer.json")


def _serve(args: list[str], health: str = "/health") -> Proc:
    return Proc("serve", ["serve", "--log-level", "warning", *args], listening_socket(), health)


def test_embedded_default_serves_both_routes_and_stops_its_workers():
    fe = _serve(["--log-level", "info"])
    try:
        workers = httpx.get(fe.url + "/v1/models").json()["workers"]
        assert [(w["protocol"], w["state"]) for w in workers] == [
            ("sglang", "up"), ("sglang", "up"), ("vllm", "up"), ("vllm", "up")]
        sglang = post(fe.url, {"text": "Hello", "sampling_params": {"max_new_tokens": 4}})
        assert sglang.status_code == 200 and len(sglang.json()["output_ids"]) == 4
        vllm = post(fe.url, {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4}},
                    path="/inference/v1/generate")
        assert vllm.status_code == 200 and len(vllm.json()["choices"][0]["token_ids"]) == 4
        fe.signal(signal.SIGTERM)
        assert fe.proc.wait(20) == 0
        for w in workers:
            with pytest.raises(httpx.ConnectError):
                httpx.get(w["url"] + "/health", timeout=2)
        # The log says they stopped, and how (a simulator ends on SIGTERM with
        # status 0), naming the pids the start-up line gave.
        lines = [line.split("] ", 1)[1] for line in fe.log().splitlines()]
        pids = {p: re.findall(r"pid (\d+)", next(x for x in lines if x.startswith(
            f"INFO asgi_generate.server.embedded: embedded {p} workers: "))) for p in ("sglang", "vllm")}
        assert [len(pids[p]) for p in pids] == [2, 2]
        assert sorted(x for x in lines if "workers stopped" in x) == [
            f"INFO asgi_generate.server.embedded: embedded {p} workers stopped: "
            + ", ".join(f"pid {pid} (exit 0)" for pid in pids[p]) for p in ("sglang", "vllm")]
    finally:
        fe.stop()


@pytest.mark.parametrize("worker_class", ["trio", "asyncio"])
def test_the_embedded_default_migrates_a_text_prompt(worker_class):
    """The simulators tokenize with the bundled tokenizer, and so does the
    frontend serving them: a streamed text prompt whose simulator is killed
    resumes on the other one, and its answer is the one an unbroken run
    gives, token for token; the log says which worker failed and how."""
    fe = _serve(["--worker-class", worker_class, "--embedded-workers", "2", "--embedded-itl-ms", "50",
                 "--log-level", "info"])
    try:
        body = {"text": "Hello there", "sampling_params": {"max_new_tokens": 80, "ignore_eos": True}}
        whole = post(fe.url, body).json()
        client = RawClient(fe.url)
        client.send(orjson.dumps({**body, "stream": True}))
        first = client.events(3)
        busy = [w for w in httpx.get(fe.url + "/stats").json()["workers"].values() if w["outstanding"]]
        assert [w["role"] for w in busy] == ["aggregated"]
        os.kill(busy[0]["pid"], signal.SIGKILL)
        rest = client.events(1000)
        client.close()
        final = orjson.loads(rest[-2])
        assert rest[-1] == b"[DONE]" and len(first) == 3
        assert (final["text"], final["output_ids"]) == (whole["text"], whole["output_ids"])
        assert final["meta_info"]["finish_reason"] == {"type": "length", "length": 80}
        # Counted when the request ends, just after its [DONE] went out.
        counters = wait_until(lambda: (c := httpx.get(fe.url + "/stats").json())["request_items"] == 2 and c)
        assert (counters["migrations"], counters["not_migrated"]) == (1, 0)
    finally:
        fe.stop()
    (line,) = [line for line in fe.log_path.read_text().splitlines() if "resuming" in line]
    assert re.search(r" INFO asgi_generate\.request\.generation: request \S+: worker w[01] "
                     r"(failed|lost): (worker broke HTTP/1\.1|connection to worker lost|health probe)[^;]*; "
                     r"resuming after \d+ tokens \(migration 1\)$", line), line


def test_a_fleet_without_a_tokenizer_says_once_that_text_prompts_will_not_migrate(tmp_path):
    sim = start_sim()
    fe = start_frontend([f"sglang={sim.url}"])
    told = start_frontend([f"sglang={sim.url}"], extra=["--tokenizer", TOKENIZER])
    try:
        lines = [line.split("] ", 1)[1] for line in fe.log_path.read_text().splitlines() if "tokenizer" in line]
        assert lines == ["WARNING asgi_generate: no --tokenizer (ASGI_GENERATE_TOKENIZER): a streamed text prompt "
                         "will not migrate when its worker dies (token-id prompts do); give the model's "
                         "tokenizer.json to resume text prompts too"]
        assert "tokenizer" not in told.log_path.read_text()
    finally:
        fe.stop()
        told.stop()
        sim.stop()


@pytest.mark.parametrize("processes", [1, 2])
def test_each_simulator_shows_its_pid_port_and_role_in_stats_and_the_log(processes):
    fe = _serve(["--log-level", "info", "--workers", str(processes), "--embedded-workers", "1", "--embedded-pd"])
    try:
        workers = httpx.get(fe.url + "/stats").json()["workers"].values()
    finally:
        fe.stop()
    log = fe.log_path.read_text()
    in_stats = sorted((w["url"], w["role"], w["pid"]) for w in workers)
    in_log = sorted((url, role, int(pid)) for url, role, pid in
                    re.findall(r"(http://127\.0\.0\.1:\d+) \((\w+), pid (\d+)\)", log))
    assert in_stats == in_log
    assert sorted(role for _, role, _ in in_stats) == ["aggregated", "aggregated", "decode", "decode",
                                                     "prefill", "prefill"]
    assert len({pid for _, _, pid in in_stats} | {fe.proc.pid}) == 7


def test_with_workers_2_each_log_line_carries_its_process_id_and_none_appears_twice():
    fe = _serve(["--log-level", "info", "--workers", "2", "--embedded-workers", "1"])
    try:
        wait_until(lambda: fe.log_path.read_text().count("Running on") == 2, timeout=10)
    finally:
        fe.stop()
    lines = [line for line in fe.log_path.read_text().splitlines() if re.match(r"\d{4}-\d\d-\d\d ", line)]
    heads = [re.match(r"\S+ \S+ \[(\d+)\] (DEBUG|INFO|WARNING|ERROR|CRITICAL) ", line) for line in lines]
    assert all(heads), [line for line, head in zip(lines, heads) if not head]
    bodies = [line.split(" ", 2)[2] for line in lines]  # the time left out
    assert len(bodies) == len(set(bodies))
    serving = {int(head[1]) for head, line in zip(heads, lines) if "Running on" in line}
    assert len(serving) == 2 and fe.proc.pid not in serving


def test_several_processes_share_the_port_and_stop_on_sigterm():
    sim = start_sim()
    fe = _serve(["--workers", "2", "--worker", f"sglang={sim.url}"])
    try:
        # The first process up answers the readiness check; the second may
        # still be starting, so requests go on (bounded) until both answered.
        prefixes, pids = set(), set()

        def minted() -> bool:
            rid = post(fe.url, {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}).json()["meta_info"]["id"]
            prefixes.add(rid[:16])
            return len(prefixes) >= 2

        wait_until(minted, timeout=30, interval=0)
        assert len(prefixes) == 2  # each process mints under its own prefix
        # /stats is per process, and says which: fresh connections reach both.
        wait_until(lambda: pids.add(httpx.get(fe.url + "/stats").json()["pid"]) or len(pids) >= 2,
                   timeout=30, interval=0)
        assert len(pids) == 2 and fe.proc.pid not in pids
        fe.signal(signal.SIGTERM)
        assert fe.proc.wait(20) == 0
    finally:
        fe.stop()
        sim.stop()


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM, and SIGKILL if it has not exited within 20 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_processes_on_a_port_each_take_a_share_and_one_killed_leaves_the_rest_serving():
    """``serve --workers 2 --port P`` on Linux: each process accepts on a
    socket of its own (SO_REUSEPORT), so fresh connections spread over both
    by the kernel's hash; the supervisor keeps no copy, so a process killed
    outright takes its socket away and every new connection reaches the other."""
    from asgi_generate.server.serving import REUSE_PORT

    if not REUSE_PORT:
        pytest.skip("SO_REUSEPORT spreads connections on Linux only")
    sim = start_sim()
    port = free_port()
    proc, _ = _spawn(["asgi_generate", "serve", "--port", str(port), "--workers", "2", "--log-level", "warning",
                      "--worker", f"sglang={sim.url}"])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: len(children(proc.pid)) == 2 and _get_ok(url + "/health"), timeout=30)
        served: dict[int, int] = {}
        for _ in range(120):  # each a fresh connection, from its own source port
            pid = httpx.get(url + "/stats", timeout=5).json()["pid"]
            served[pid] = served.get(pid, 0) + 1
        assert set(served) == set(children(proc.pid)) and min(served.values()) >= 30, served
        victim, survivor = list(served)
        os.kill(victim, signal.SIGKILL)
        # Reaped by the supervisor, not only a zombie: a killed process's
        # leader shows as a zombie while its other threads still exit and
        # hold its listening socket, whose queued connections the kernel
        # resets when it finally closes.
        wait_until(lambda: not pathlib.Path(f"/proc/{victim}").exists(), timeout=10)
        assert {httpx.get(url + "/stats", timeout=5).json()["pid"] for _ in range(30)} == {survivor}
    finally:
        try:
            _stop(proc)
        finally:
            sim.stop()


@pytest.mark.parametrize("worker_class", ["asyncio", "trio"])
def test_processes_on_a_port_even_out_keep_alive_connections(worker_class):
    """32 keep-alive clients of ``serve --workers 2 --port P``: the kernel's
    hash splits their connections unevenly (17/15 or worse, mostly); a
    process over its share answers with ``connection: close`` (one
    connection at a time), the client connects anew, until 16/16."""
    from asgi_generate.server.serving import REUSE_PORT

    if not REUSE_PORT:
        pytest.skip("SO_REUSEPORT spreads connections on Linux only")
    port = free_port()
    proc, _ = _spawn(["asgi_generate", "serve", "--port", str(port), "--workers", "2", "--log-level", "warning",
                      "--embedded-workers", "1", "--worker-class", worker_class])
    url = f"http://127.0.0.1:{port}"
    clients = [httpx.Client(timeout=5) for _ in range(32)]
    try:
        wait_until(lambda: _get_ok(url + "/health"), timeout=30)
        splits = []
        for _ in range(30):  # bounded: rounds of one request per client, each on its kept connection
            per_pid: dict[int, int] = {}
            for client in clients:
                pid = client.get(url + "/stats").json()["pid"]
                per_pid[pid] = per_pid.get(pid, 0) + 1
            splits.append(sorted(per_pid.values()))
            if splits[-1] == [16, 16]:
                break
        assert splits[-1] == [16, 16], splits
    finally:
        for client in clients:
            client.close()
        _stop(proc)


def test_help_documents_every_serve_flag():
    out = subprocess.run([sys.executable, "-m", "asgi_generate", "serve", "--help"],
                         capture_output=True, text=True, check=True).stdout
    for flag in ("--worker PROTOCOL=URL", "--host", "--port", "--worker-class", "--workers",
                 "--max-body-bytes", "--connect-timeout", "--headers-timeout", "--first-token-timeout",
                 "--inter-token-timeout", "--read-timeout", "--request-timeout", "--health-interval",
                 "--health-timeout", "--health-failures",
                 "--sse-keepalive", "--abort-timeout", "--slow-client-timeout", "--shutdown-grace",
                 "--embedded-workers", "--trace-file", "--skip-broken-codecs", "--otlp-endpoint URL",
                 "--trace-otlp"):
        assert flag in out


@pytest.mark.parametrize("command,limit", [
    (["hypercorn", "-k", "trio", "-b", "fd://{fd}", "asgi_generate.server.asgi:app"], 1000),
    (["asgi_generate", "serve", "--fd", "{fd}", "--log-level", "warning"], 1000),
    (["asgi_generate", "serve", "--fd", "{fd}", "--log-level", "warning", "--max-body-bytes", "2000"], 2000),
])
def test_variables_configure_hypercorn_and_serve_alike_and_flags_win(command, limit):
    sim = start_sim()
    proc, url = _spawn(command, {"ASGI_GENERATE_WORKERS": f"sglang={sim.url}", "ASGI_GENERATE_MAX_BODY_BYTES": "1000"})
    try:
        wait_until(lambda: _get_ok(url + "/health"), timeout=30)
        workers = httpx.get(url + "/v1/models").json()["workers"]
        assert [(w["protocol"], w["url"]) for w in workers] == [("sglang", sim.url)]
        ok = post(url, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3}})
        assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 3
        big = post(url, {"input_ids": list(range(600))})
        assert big.status_code == 413
        assert big.json()["message"] == f"request body exceeds the limit of {limit} bytes"
    finally:
        proc.terminate()
        proc.wait(20)
        sim.stop()


def _spawn(args: list[str], env: dict | None = None, output=subprocess.DEVNULL, **kw) -> tuple[subprocess.Popen, str]:
    """``python -m ARGS`` serving a fresh loopback socket (``{fd}`` in
    ``args`` is its descriptor), with ``env`` added to the environment;
    returns the process and its URL."""
    sock = listening_socket()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    proc = subprocess.Popen([sys.executable, "-m", *(a.replace("{fd}", str(sock.fileno())) for a in args)],
                            pass_fds=[sock.fileno()], env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL,
                            stdout=output, stderr=subprocess.STDOUT if output is not subprocess.PIPE else output,
                            **kw)
    sock.close()
    return proc, url


def _hypercorn(env: dict, *extra: str, output=subprocess.DEVNULL) -> tuple[subprocess.Popen, str]:
    return _spawn(["hypercorn", *extra, "-b", "fd://{fd}", "asgi_generate.server.asgi:app"], env, output)


def _get_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


# -- signals and lifecycle ------------------------------------------------------


def _gone(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


@pytest.mark.parametrize("worker_class,processes", [("trio", 1), ("asyncio", 1), ("asyncio", 2)])
def test_ctrl_c_to_the_process_group_lets_an_inflight_stream_finish(tmp_path, worker_class, processes):
    """A terminal's Ctrl-C signals the whole foreground process group: the
    embedded simulators must not die with it, but outlive the frontend's drain."""
    pid_file = tmp_path / "serve.pid"
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log_file:
        proc, url = _spawn(
            ["asgi_generate", "serve", "--fd", "{fd}", "--worker-class", worker_class, "--workers", str(processes),
             "--embedded-workers", "1", "--embedded-itl-ms", "15", "--shutdown-grace", "20",
             "--pid-file", str(pid_file)],
            output=log_file, start_new_session=True)  # a process group of its own, as a terminal's job
    try:
        wait_until(lambda: _get_ok(url + "/health"), timeout=30)
        assert pid_file.read_text() == f"{proc.pid}\n"
        assert f"pid {proc.pid}, listening on {url}" in log_path.read_text()
        descendants = children(proc.pid)
        descendants += [g for c in descendants for g in children(c)]
        assert len(descendants) == 2 + (processes if processes > 1 else 0)  # one simulator per protocol
        client = RawClient(url)
        body = {"input_ids": [1, 2], "stream": True, "sampling_params": {"max_new_tokens": 100, "ignore_eos": True}}
        client.send(orjson.dumps(body))
        first = client.events(3)
        os.killpg(proc.pid, signal.SIGINT)
        rest = client.events(200)
        client.close()
        events = first + rest
        assert events[-1] == b"[DONE]"
        final = orjson.loads(events[-2])
        assert len(final["output_ids"]) == 100
        assert final["meta_info"]["finish_reason"] == {"type": "length", "length": 100}
        assert proc.wait(30) == 0
        assert not pid_file.exists()
        wait_until(lambda: all(_gone(p) for p in descendants), timeout=10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_a_ctrl_c_while_starting_up_stops_cleanly(tmp_path):
    """A Ctrl-C that lands while ``serve`` is still starting (its simulators
    coming up) is kept and honoured once serving begins: exit 0, no
    traceback, every process gone. (A ``--workers`` child that a forwarded
    stop reaches while it still imports dies of that signal, which the
    supervisor counts as the clean stop it asked for: see the test above.)"""
    log_path = tmp_path / "serve.log"
    pid_file = tmp_path / "serve.pid"
    with open(log_path, "wb") as log_file:
        proc, _url = _spawn(
            ["asgi_generate", "serve", "--fd", "{fd}", "--worker-class", "asyncio",
             "--embedded-workers", "1", "--pid-file", str(pid_file)],
            output=log_file, start_new_session=True)
    try:
        wait_until(pid_file.exists, timeout=30, interval=0.005)
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(30) == 0, log_path.read_text()
        log = log_path.read_text()
        assert "Traceback" not in log and "SIGINT: shutting down gracefully" in log
        sims = re.findall(r"embedded \w+ workers: (http://\S+)", log)
        assert len(sims) == 2  # it started its simulators, then stopped them
        for sim_url in sims:
            wait_until(lambda: not _get_ok(sim_url + "/health"), timeout=10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


# -- startup and configuration errors -------------------------------------------


def test_a_bad_start_from_the_command_line_is_one_line_and_exit_2():
    """The console entry itself (tests/server/test_cli_errors.py checks
    every refusal in process): a bad flag, a bad variable, a bad simulator
    flag, each one line on stderr and exit status 2, nothing on stdout."""
    cases = [
        (["serve", "--port", "0", "--max-body-bytes", "-5"], {},
         "asgi-generate: --max-body-bytes (ASGI_GENERATE_MAX_BODY_BYTES) must be above 0, not -5"),
        (["serve", "--port", "0"], {"ASGI_GENERATE_WORKER": "sglang=http://h:1"},
         "asgi-generate: unknown variable ASGI_GENERATE_WORKER: did you mean ASGI_GENERATE_WORKERS? "
         "(asgi-generate serve --help lists the settings)"),
        (["sim", "--port", "0", "--stream-interval", "0"], {},
         "asgi-generate sim: error: argument --stream-interval: must be 1 or more, not 0 (see --help)"),
    ]
    for args, env, line in cases:
        out = subprocess.run([sys.executable, "-m", "asgi_generate", *args],
                             capture_output=True, text=True, timeout=30, env={**os.environ, **env})
        assert (out.returncode, out.stderr, out.stdout) == (2, line + "\n", "")


def test_a_port_in_use_is_one_line_before_any_simulator_starts():
    taken = listening_socket()
    port = taken.getsockname()[1]
    try:
        out = subprocess.run([sys.executable, "-m", "asgi_generate", "serve", "--port", str(port)],
                             capture_output=True, text=True, timeout=30)
    finally:
        taken.close()
    assert (out.returncode, out.stderr) == (2, f"asgi-generate: cannot listen on 127.0.0.1:{port}: "
                                               "Address already in use\n")


def test_detach_on_a_port_in_use_fails_at_once_and_writes_no_pid_file(tmp_path):
    """The README's first command starts the server with --detach: a busy
    port is its exit status and one line on the terminal."""
    taken = listening_socket()
    port = taken.getsockname()[1]
    pid_file, log = tmp_path / "serve.pid", tmp_path / "serve.log"
    try:
        out = subprocess.run([sys.executable, "-m", "asgi_generate", "serve", "--port", str(port), "--detach",
                              "--pid-file", str(pid_file), "--log-file", str(log)],
                             capture_output=True, text=True, timeout=30)
    finally:
        taken.close()
    assert (out.returncode, out.stderr) == (2, f"asgi-generate: cannot listen on 127.0.0.1:{port}: "
                                               "Address already in use\n")
    assert not pid_file.exists() and not log.exists()


@pytest.mark.parametrize("processes", [1, 2])
def test_detach_returns_once_the_server_answers_and_its_pid_file_stops_it(tmp_path, processes):
    port = free_port()
    pid_file, log = tmp_path / "serve.pid", tmp_path / "serve.log"
    out = subprocess.run([sys.executable, "-m", "asgi_generate", "serve", "--port", str(port), "--detach",
                          "--workers", str(processes), "--embedded-workers", "1", "--pid-file", str(pid_file),
                          "--log-file", str(log)], capture_output=True, text=True, timeout=60)
    pid = int(pid_file.read_text())
    try:
        assert (out.returncode, out.stderr) == (0, f"asgi-generate: serving http://127.0.0.1:{port} in the "
                                                   f"background: pid {pid}, log {log}\n")
        assert os.getsid(pid) == pid  # a session of its own: no terminal signal reaches it
        # Answered at once, no retry: every process serves.
        got = {httpx.get(f"http://127.0.0.1:{port}/stats", timeout=5).json()["pid"] for _ in range(20)}
        assert len(got) == processes
        os.kill(pid, signal.SIGTERM)
        wait_until(lambda: _gone(pid), timeout=30)
        assert not pid_file.exists()
        assert f"pid {pid}, listening on http://127.0.0.1:{port}" in log.read_text()
    finally:
        if not _gone(pid):
            os.killpg(pid, signal.SIGKILL)


def test_detach_reports_a_server_that_stops_before_serving(tmp_path):
    log = tmp_path / "serve.log"
    out = subprocess.run([sys.executable, "-m", "asgi_generate", "serve", "--port", str(free_port()), "--detach",
                          "--log-level", "warning", "--pid-file", str(tmp_path / "missing" / "serve.pid"),
                          "--log-file", str(log)], capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stderr) == (2, (
        f"asgi-generate: --pid-file: cannot write '{tmp_path}/missing/serve.pid': No such file or directory\n"
        f"asgi-generate: the server stopped before serving (exit status 2); its log: {log}\n"))


@pytest.mark.parametrize("extra,code", [((), 0), (("-w", "0"), 2)])
def test_a_bad_variable_under_hypercorn_is_one_line(extra, code):
    """hypercorn's parent exits 0 whatever its worker process did (hypercorn
    issue #269); with ``-w 0`` the app runs in it and the status is ours."""
    proc, _ = _hypercorn({"ASGI_GENERATE_MAX_BODY_BYTES": "-5"}, *extra, output=subprocess.PIPE)
    try:
        _, err = proc.communicate(timeout=30)
    finally:  # it serves when the value is not refused
        proc.terminate()
        proc.wait(20)
    assert err.decode() == "asgi-generate: --max-body-bytes (ASGI_GENERATE_MAX_BODY_BYTES) must be above 0, not -5\n"
    assert proc.returncode == code


def test_under_hypercorn_simulators_and_worker_state_changes_are_logged(tmp_path):
    log_path = tmp_path / "hypercorn.log"
    free = listening_socket()
    port = free.getsockname()[1]
    free.close()
    with open(log_path, "wb") as log_file:
        embedded, url = _hypercorn({"ASGI_GENERATE_EMBEDDED_WORKERS": "1"}, output=log_file)
        try:
            wait_until(lambda: _get_ok(url + "/health"), timeout=30)
            assert ("WARNING] asgi_generate.server.embedded: no worker configured (--worker, ASGI_GENERATE_WORKERS): "
                    "serving 1 simulated worker(s) per protocol (sglang, vllm), not real engines") in log_path.read_text()
        finally:
            embedded.terminate()
            embedded.wait(20)
    log_path.write_bytes(b"")
    worker = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log_file:
        fe, url = _hypercorn({"ASGI_GENERATE_WORKERS": f"sglang={worker}", "ASGI_GENERATE_HEALTH_INTERVAL": "0.2"},
                             output=log_file)
        sim = None
        try:
            down = f"WARNING] asgi_generate.router: worker w0 ({worker}) marked down: "
            wait_until(lambda: log_path.read_text().count(down) == 1, timeout=30)
            sim = start_sim(port=port)
            wait_until(lambda: f"INFO] asgi_generate.router: worker w0 ({worker}) is up" in log_path.read_text(),
                       timeout=10)
            sim.stop()
            wait_until(lambda: log_path.read_text().count(down) == 2, timeout=10)
        finally:
            if sim is not None:
                sim.stop()
            fe.terminate()
            fe.wait(20)


# -- --version, --help, access log, /stats ----------------------------------------


def test_version():
    out = subprocess.run([sys.executable, "-m", "asgi_generate", "--version"], capture_output=True, text=True)
    assert (out.returncode, out.stdout) == (0, f"asgi-generate {asgi_generate.__version__}\n")


@pytest.mark.parametrize("command", ["serve", "sim"])
def test_help_gives_every_flag_its_default_and_choices(command):
    from asgi_generate.server.cli import build_parser

    out = subprocess.run([sys.executable, "-m", "asgi_generate", command, "--help"], env={**os.environ, "COLUMNS": "200"},
                         capture_output=True, text=True, check=True).stdout
    blocks = {}
    for line in out.split("options:", 1)[1].splitlines():
        if line.startswith("  -"):
            key = line.split()[0].rstrip(",")
            blocks[key] = line
        elif line.strip():
            blocks[key] += " " + line.strip()
    sub = build_parser()._subparsers._group_actions[0].choices[command]
    for action in sub._actions:
        if action.option_strings == ["-h", "--help"]:
            continue
        text = blocks[action.option_strings[0]]
        assert "(default" in text, text
        for choice in action.choices or ():
            assert choice in text, (choice, text)


@pytest.mark.parametrize("worker_class", ["trio", "asyncio"])
def test_one_access_log_line_per_request_at_info(worker_class):
    sim = start_sim()
    fe = Proc("serve", ["serve", "--worker", f"sglang={sim.url}", "--worker-class", worker_class],
              listening_socket(), "/health")
    try:
        assert post(fe.url, {"input_ids": [1], "sampling_params": {"max_new_tokens": 2}},
                    headers={"user-agent": "access-log-test"}).status_code == 200
        pattern = re.compile(r'INFO hypercorn\.access: 127\.0\.0\.1:\d+ - - \[[^]]+\] "POST /generate 1\.1" 200 \d+ '
                             r'"-" "access-log-test"')
        wait_until(lambda: len(pattern.findall(fe.log())) == 1, timeout=5)
    finally:
        fe.stop()
        sim.stop()


def test_the_processes_of_serve_workers_n_stop_when_the_supervisor_dies(tmp_path):
    """Children in sessions of their own get no signal from the supervisor's
    terminal: the kernel sends them SIGTERM when it dies, and the simulators
    watch it themselves."""
    proc, url = _spawn(["asgi_generate", "serve", "--fd", "{fd}", "--workers", "2", "--embedded-workers", "1",
                        "--log-level", "warning"], start_new_session=True)
    kids: list[int] = []
    try:
        wait_until(lambda: _get_ok(url + "/health"), timeout=30)
        kids = children(proc.pid)
        assert len(kids) == 4  # two frontend processes, a simulator per protocol
        proc.kill()
        proc.wait(10)
        wait_until(lambda: all(_gone(p) for p in kids), timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for pid in kids:  # in sessions of their own: nothing else reaches them
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_check_reports_the_hash_accelerator():
    """``asgi-generate check`` says whether the hash chains run in C: as this
    install does, and ``false`` where the accelerator was never built (an
    install without a C compiler)."""
    out = subprocess.run([sys.executable, "-m", "asgi_generate", "check"], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert orjson.loads(out) == {"version": asgi_generate.__version__, "hash_accelerator": hashes.ACCELERATED}
    code = ("import sys\nsys.modules['asgi_generate.hashes._native'] = None  # as if never built\n"
            "from asgi_generate.server.cli import main\nsys.exit(main(['check']))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out == '{"version":"%s","hash_accelerator":false}\n' % asgi_generate.__version__


@pytest.mark.parametrize("worker_class", WORKER_CLASSES)
def test_stats_reports_the_hash_accelerator(worker_class):
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))  # bound, never listening: /stats needs no worker up
    try:
        fe = start_frontend([f"sglang=http://127.0.0.1:{dead.getsockname()[1]}"], worker_class=worker_class,
                            health="/stats")
        try:
            assert httpx.get(fe.url + "/stats", timeout=10).json()["hash_accelerator"] is hashes.ACCELERATED
        finally:
            fe.stop()
    finally:
        dead.close()
