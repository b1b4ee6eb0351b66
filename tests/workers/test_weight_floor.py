"""The minimum weight version a request asks for
(``asgi-generate-min-weight-version``; asgi_generate/workers/fence.py):
which workers meet which floor, an engine's initial version (``default``)
below every version a trainer sets, and the 503's message when none does."""

from __future__ import annotations

import pytest

from asgi_generate.workers.fence import INITIAL_VERSION, RouteKey, version_order
from asgi_generate.workers.router import Router

#: Each worker's weight version; w1's engine gives none (unknown).
VERSIONS = ("default", None, "8", "10", "1.2.3", "v1")


def _router(versions=VERSIONS) -> Router:
    router = Router([("sglang", f"http://127.0.0.1:{31000 + i}") for i in range(len(versions))])
    for w, version in zip(router.workers, versions):
        w.healthy = True
        w.info = {} if version is None else {"weight_version": version}
    return router


@pytest.mark.parametrize(("floor", "admitted"), [
    ("1", ["w2", "w3", "w4", "w5"]),
    ("8", ["w2", "w3", "w5"]),
    ("1.2.3", ["w2", "w3", "w4", "w5"]),
    ("99999999999999999999999999", ["w5"]),
    ("v1", ["w5"]),
    ("v2", []),
    ("defaulu", ["w5"]),
    ("default.1", ["w5"]),
    # Every known version is at or after the initial one.
    ("default", ["w0", "w2", "w3", "w4", "w5"]),
])
def test_which_workers_meet_each_floor(floor, admitted):
    router = _router()
    assert [w.id for w in router.workers if router.routable(w, floor)] == admitted


def test_the_initial_version_ranks_below_every_other():
    assert INITIAL_VERSION == "default"
    ranked = sorted(["v10", "default.1", "1.2.3", "10", "default", "v9", "8", "defaulu", "1", "0"],
                    key=version_order)
    assert ranked == ["default", "0", "1", "1.2.3", "8", "10", "default.1", "defaulu", "v9", "v10"]


def test_a_fleet_at_its_initial_version_answers_a_numeric_floor_with_the_reason():
    router = _router(("default", "default", None))
    assert router.pick("sglang", key=RouteKey(None, "8")) is None
    assert router.unavailable("sglang", RouteKey(None, "8")) == (
        "no healthy worker for protocol 'sglang' at weight version '8' or later "
        "(w0: default, w1: default, w2: None)")
    assert router.pick("sglang", key=RouteKey(None, "default")).id == "w0"
