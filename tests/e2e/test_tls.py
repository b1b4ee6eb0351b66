"""TLS across hosts: ``https://`` workers (verified against --worker-ca-file,
refused without it, --worker-insecure) and the frontend serving HTTPS, with
a throwaway CA made by ``trustme``."""

from __future__ import annotations

import subprocess
import sys

import anyio
import httpx
import orjson
import pytest
import trustme

from asgi_generate.exceptions import ConnectFailed
from asgi_generate.workers.http import ConnectionPool, tls_context
from support import CONTINUATION, PROMPT, RawClient, start_frontend, start_sim, stats, wait_until

pytestmark = pytest.mark.e2e

UNARY = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8}}
VERIFY_FAILED = "certificate verify failed: unable to get local issuer certificate"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA and a certificate for 127.0.0.1 it signed: ``ca.pem``,
    ``cert.pem`` (the chain), ``key.pem``."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    d = tmp_path_factory.mktemp("pki")
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    cert.private_key_pem.write_to_path(str(d / "key.pem"))
    (d / "cert.pem").write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    return d


def _serve_tls(pki) -> list[str]:
    return ["--certfile", str(pki / "cert.pem"), "--keyfile", str(pki / "key.pem")]


@pytest.fixture(scope="module")
def https_sim(pki):
    """An SGLang simulator serving HTTPS, 20 ms per token."""
    sim = start_sim("sglang", itl_ms=20, extra=_serve_tls(pki), verify=str(pki / "ca.pem"))
    yield sim
    sim.stop()


@pytest.mark.parametrize("worker_class", ["trio", "asyncio"])
def test_https_worker_verified_with_the_ca_file(pki, https_sim, worker_class):
    fe = start_frontend([f"sglang={https_sim.url}"], worker_class=worker_class,
                        extra=["--worker-ca-file", str(pki / "ca.pem")])
    try:
        before = stats(https_sim)
        r = httpx.post(fe.url + "/generate", json=UNARY, timeout=30)
        assert (r.status_code, r.json()["output_ids"]) == (200, CONTINUATION[:8])
        # A client that hangs up mid-stream: the abort goes over TLS too.
        client = RawClient(fe.url)
        client.send(orjson.dumps({**UNARY, "sampling_params": {"max_new_tokens": 200}, "stream": True}))
        assert len(client.events(2)) == 2
        client.close()
        wait_until(lambda: httpx.get(fe.url + "/stats").json()["aborts_acknowledged"] == 1)
        after = stats(https_sim)
        assert after["abort_requests"] - before["abort_requests"] == 1
        assert after["generate_requests"] - before["generate_requests"] == 2
        (worker,) = httpx.get(fe.url + "/v1/models").json()["workers"]
        assert (worker["url"], worker["state"], worker["last_error"]) == (https_sim.url, "up", None)
    finally:
        fe.stop()


def test_https_worker_without_the_ca_is_refused_and_down(https_sim):
    fe = start_frontend([f"sglang={https_sim.url}"], health="/v1/models")
    try:
        (worker,) = httpx.get(fe.url + "/v1/models").json()["workers"]
        assert (worker["state"], worker["last_error"]) == (
            "down", f"TLS handshake with 127.0.0.1:{https_sim.port} failed: {VERIFY_FAILED}")
        r = httpx.post(fe.url + "/generate", json=UNARY, timeout=30)
        assert (r.status_code, r.json()) == (503, {"object": "error", "message": "no healthy worker for protocol "
                                                   "'sglang'", "type": "503", "param": None, "code": 503})
    finally:
        fe.stop()


def test_worker_insecure_skips_verification_and_says_so(https_sim):
    fe = start_frontend([f"sglang={https_sim.url}"], extra=["--worker-insecure"])
    try:
        r = httpx.post(fe.url + "/generate", json=UNARY, timeout=30)
        assert (r.status_code, r.json()["output_ids"]) == (200, CONTINUATION[:8])
        assert "--worker-insecure: TLS certificates of https:// workers are NOT verified" in fe.log()
    finally:
        fe.stop()


@pytest.mark.parametrize("worker_class,processes", [("trio", "1"), ("asyncio", "2")])
def test_frontend_serves_https(pki, worker_class, processes):
    sim = start_sim("sglang")
    try:
        fe = start_frontend([f"sglang={sim.url}"], worker_class=worker_class, verify=str(pki / "ca.pem"),
                            extra=[*_serve_tls(pki), "--workers", processes])
        try:
            assert fe.url.startswith("https://")
            with httpx.Client(verify=fe.tls()) as client:
                for _ in range(4):  # fresh connections, whichever process takes them
                    r = client.post(fe.url + "/generate", json=UNARY, headers={"connection": "close"}, timeout=30)
                    assert (r.status_code, r.json()["output_ids"]) == (200, CONTINUATION[:8])
            with pytest.raises(httpx.ConnectError):  # not trusted without the CA
                httpx.post(fe.url + "/generate", json=UNARY, timeout=30)
        finally:
            fe.stop()
    finally:
        sim.stop()


@pytest.mark.parametrize("worker_class", ["asyncio", "uvloop", "trio"])
def test_frontend_speaks_h2_to_clients_that_offer_it(pki, worker_class):
    # hypercorn picks h2 by ALPN; the asyncio worker's own connection
    # (hypercorn_asyncio.Connection) hands such a connection to H2Protocol.
    sim = start_sim("sglang")
    try:
        fe = start_frontend([f"sglang={sim.url}"], worker_class=worker_class, verify=str(pki / "ca.pem"),
                            extra=_serve_tls(pki))
        try:
            with httpx.Client(verify=fe.tls(), http2=True) as client:
                for _ in range(2):  # two requests, two streams of one connection
                    r = client.post(fe.url + "/generate", json=UNARY, timeout=30)
                    assert (r.http_version, r.status_code, r.json()["output_ids"]) == (
                        "HTTP/2", 200, CONTINUATION[:8])
                r = client.post(fe.url + "/generate", json={**UNARY, "stream": True}, timeout=30)
                events = [line for line in r.text.split("\n\n") if line]
                assert (r.http_version, r.status_code, events[-1]) == ("HTTP/2", 200, "data: [DONE]")
                assert orjson.loads(events[-2][len("data: "):])["output_ids"] == CONTINUATION[:8]
            with httpx.Client(verify=fe.tls()) as client:
                r = client.post(fe.url + "/generate", json=UNARY, timeout=30)
                assert (r.http_version, r.status_code) == ("HTTP/1.1", 200)
        finally:
            fe.stop()
    finally:
        sim.stop()


@pytest.mark.parametrize("worker_class", ["asyncio", "trio"])
def test_frontend_takes_cleartext_h2_with_prior_knowledge(worker_class):
    # No TLS, no ALPN: the h2 preface on an HTTP/1.1 connection turns it
    # into h2 (hypercorn's ProtocolWrapper switch, asgi_generate.server.hypercorn.lean's handle).
    sim = start_sim("sglang")
    try:
        fe = start_frontend([f"sglang={sim.url}"], worker_class=worker_class)
        try:
            with httpx.Client(http1=False, http2=True) as client:
                for _ in range(2):  # two streams of one connection
                    r = client.post(fe.url + "/generate", json=UNARY, timeout=30)
                    assert (r.http_version, r.status_code, r.json()["output_ids"]) == (
                        "HTTP/2", 200, CONTINUATION[:8])
        finally:
            fe.stop()
    finally:
        sim.stop()


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


@pytest.mark.anyio
async def test_pool_speaks_tls_and_a_failed_handshake_is_a_failed_connect(pki, https_sim):
    good = ConnectionPool("127.0.0.1", https_sim.port, ssl_context=tls_context(str(pki / "ca.pem")))
    for _ in range(2):  # the second request reuses the kept-alive TLS connection
        async with good.request(b"GET", b"/health") as resp:
            assert (resp.status, await resp.read()) == (200, b"")
    assert (good.opened, good.idle) == (1, 1)
    await good.aclose()
    bad = ConnectionPool("127.0.0.1", https_sim.port, ssl_context=tls_context())
    with pytest.raises(ConnectFailed) as exc:
        async with bad.request(b"GET", b"/health"):
            pass
    assert str(exc.value) == f"TLS handshake with 127.0.0.1:{https_sim.port} failed: {VERIFY_FAILED}"
    with anyio.fail_after(5):
        insecure = ConnectionPool("127.0.0.1", https_sim.port, ssl_context=tls_context(insecure=True))
        async with insecure.request(b"GET", b"/health") as resp:
            assert resp.status == 200
            await resp.read()
        await insecure.aclose()


@pytest.mark.parametrize("args,error", [
    (["--certfile", "c.pem"], "--certfile and --keyfile go together"),
    (["--ciphers", "ECDHE+AESGCM"], "--ca-certs and --ciphers need --certfile and --keyfile"),
    (["--certfile", "nope.pem", "--keyfile", "nope.key"],
     "cannot serve HTTPS with --certfile 'nope.pem' --keyfile 'nope.key': No such file or directory"),
    (["--worker-ca-file", "nope.pem"],
     "--worker-ca-file (ASGI_GENERATE_WORKER_CA_FILE): cannot load 'nope.pem': No such file or directory"),
])
def test_bad_tls_flags_are_one_line(tmp_path, args, error):
    done = subprocess.run([sys.executable, "-m", "asgi_generate", "serve", "--port", "0", *args],
                          capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert (done.returncode, done.stderr) == (2, f"asgi-generate: {error}\n")
