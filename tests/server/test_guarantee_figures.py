"""The figures docs/guarantees.md states, as the code has them: the listen
queue, how long an idle pooled connection is trusted, and how long a hung
worker stays in the rotation by default."""

from __future__ import annotations

from asgi_generate.config import Settings
from asgi_generate.server.serving import LISTEN_BACKLOG
from asgi_generate.workers.http import IDLE_TIMEOUT


def test_the_listen_queue_holds_2048_connections():
    assert LISTEN_BACKLOG == 2048


def test_an_idle_connection_is_reused_only_within_4_s():
    # Both engines' uvicorn closes an idle keep-alive connection after 5 s
    # (uvicorn's --timeout-keep-alive default).
    assert IDLE_TIMEOUT == 4.0


def test_a_hung_worker_leaves_the_rotation_within_96_s_by_default():
    s = Settings()
    assert (s.health_failures, s.health_timeout, s.health_interval) == (3, 30.0, 2.0)
    assert s.health_failures * (s.health_timeout + s.health_interval) == 96.0
