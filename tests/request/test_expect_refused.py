"""A client refused on its headers gets the refusal and no ``100
Continue``, so it never uploads: past the declared-length cap (413,
tests/request/test_body_bounds.py) and, here, when its body does not fit
the body budget within ``--body-budget-wait`` (503 with ``Retry-After``)."""

from __future__ import annotations

import orjson
import pytest

from test_body_bounds import (MAX_BODY, Upload, body_sims, impatient, new_records, settled_records, wait_idle,
                              wait_stats)

__all__ = ["body_sims", "impatient"]  # the fixtures, imported for their frontends (short body deadlines)


@pytest.mark.e2e
def test_a_body_that_does_not_fit_the_budget_gets_503_and_no_100_continue(impatient):
    wait_idle(impatient)
    seen = settled_records(impatient)
    holder = Upload(impatient, "/generate", MAX_BODY)  # holds 4 of the 6 MiB
    holder.send(b'{"input_ids": [')
    wait_stats(impatient, lambda s: s["body_budget"]["in_use_bytes"] == MAX_BODY)
    late = Upload(impatient, "/generate", MAX_BODY, expect=True)
    try:
        informational, status, headers, body, closed = late.response()
    finally:
        late.close()
        holder.close()
    assert informational == []  # never asked for its body
    assert (status, headers["retry-after"], headers["connection"], closed) == (503, "1", "close", True)
    assert orjson.loads(body) == {"object": "error", "message": "too many request bodies in flight; retry later",
                                  "type": "503", "param": None, "code": 503}
    by_status = {r["status"]: r for r in new_records(impatient, seen, 2)}
    assert sorted(by_status) == ["client_disconnect", "unavailable"]  # the holder, the late one
    assert by_status["unavailable"]["http_status"] == 503
