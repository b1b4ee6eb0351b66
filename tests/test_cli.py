"""The command line: the embedded default, several processes, --help."""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx
import pytest

from support import Proc, listening_socket, post, start_sim, wait_until


def _serve(args: list[str], health: str = "/health") -> Proc:
    return Proc("serve", ["serve", "--log-level", "warning", *args], listening_socket(), health)


def test_embedded_default_serves_both_routes_and_stops_its_workers():
    fe = _serve([])
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
    finally:
        fe.stop()


def test_several_processes_share_the_port_and_stop_on_sigterm():
    sim = start_sim()
    fe = _serve(["--workers", "2", "--worker", f"sglang={sim.url}"])
    try:
        prefixes = set()
        for _ in range(40):
            rid = post(fe.url, {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}).json()["meta_info"]["id"]
            prefixes.add(rid[:16])
        assert len(prefixes) == 2  # each process mints under its own prefix
        fe.signal(signal.SIGTERM)
        assert fe.proc.wait(20) == 0
    finally:
        fe.stop()
        sim.stop()


def test_help_documents_every_serve_flag():
    out = subprocess.run([sys.executable, "-m", "asgi_generate", "serve", "--help"],
                         capture_output=True, text=True, check=True).stdout
    for flag in ("--worker PROTOCOL=URL", "--host", "--port", "--worker-class", "--workers",
                 "--max-body-bytes", "--connect-timeout", "--read-timeout", "--health-interval",
                 "--sse-keepalive", "--abort-timeout", "--slow-client-timeout", "--shutdown-grace",
                 "--embedded-workers", "--trace-file", "--skip-broken-codecs"):
        assert flag in out


def test_hypercorn_run_directly_is_configured_from_the_environment():
    import os

    sim = start_sim()
    sock = listening_socket()
    port = sock.getsockname()[1]
    env = {**os.environ, "ASGI_GENERATE_WORKERS": f"sglang={sim.url}", "ASGI_GENERATE_MAX_BODY_BYTES": "1000"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "hypercorn", "-k", "trio", "-b", f"fd://{sock.fileno()}", "asgi_generate.asgi:app"],
        pass_fds=[sock.fileno()], env=env, stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sock.close()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _get_ok(url + "/health"), timeout=30)
        ok = post(url, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3}})
        assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 3
        big = post(url, {"input_ids": list(range(300))})
        assert big.status_code == 413
        assert big.json()["message"] == "request body exceeds the limit of 1000 bytes"
    finally:
        proc.terminate()
        proc.wait(20)
        sim.stop()


def _get_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
