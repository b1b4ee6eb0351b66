"""The reads a health probe makes are the only requests the frontend sends
twice: a server-info read (the info route, the model list, the version)
the worker dropped on a reused connection gets one fresh try, as a health
read does (tests/request/test_unanswered.py), and the worker comes up with
what the second try read."""

from __future__ import annotations

import anyio
import orjson
import pytest

from asgi_generate.workers.router import Router
from scripted_worker import _response, _serve

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["trio", "asyncio"])
def anyio_backend(request):
    return request.param


async def test_a_server_info_read_the_worker_dropped_is_retried_once():
    models = orjson.dumps({"object": "list", "data": [{"id": "m", "root": "m", "max_model_len": 1234}]})
    script = [_response(b""), None, _response(models), _response(b'{"version": "0.33.0"}'),
              _response(b'{"weight_version": "v7"}')]
    async with anyio.create_task_group() as tg:
        server, pool = await _serve(tg, script)
        router = Router([("vllm", f"http://127.0.0.1:{pool.port}")])
        (w,) = router.workers
        assert not w.healthy  # a worker not up yet: the probe reads its server info too
        assert await router.probe(w) is True
        await router.aclose()
        tg.cancel_scope.cancel()
    assert server.requests == [(1, b"GET /health HTTP/1.1", b""), (1, b"GET /v1/models HTTP/1.1", b""),
                               (2, b"GET /v1/models HTTP/1.1", b""), (2, b"GET /version HTTP/1.1", b""),
                               (2, b"GET /weight_info HTTP/1.1", b"")]
    assert (w.healthy, w.failures, w.info["max_model_len"], w.info["version"], w.info["weight_version"]) == (
        True, 0, 1234, "0.33.0", "v7")
    assert (w.probe_pool.opened, w.probe_pool.retired) == (2, 1)
