"""A client is owed at most the events of one worker read: everything the
leg decoded from one read of the worker's connection (at most
``asgi_generate.workers.http.RECEIVE_SIZE``, 64 KiB) goes to the client as
one write."""

from __future__ import annotations

import pytest

from asgi_generate.workers.http import RECEIVE_SIZE
from asgi_generate_sglang import SGLangCodec
from test_legs import Client, FakePool, FakeResponse, FakeRouter, answer, anyio_backend, minted, sse, worker

__all__ = ["anyio_backend", "minted"]  # the fixtures, imported for their runs

STREAM = {"input_ids": [1, 2], "rid": "mine", "stream": True, "sampling_params": {"max_new_tokens": 5}}


def _event(ids: list[int], finish: dict | None = None) -> bytes:
    """The SSE event the client gets for ``answer(ids, finish)``, its id swapped back."""
    return b"data: " + (b'{"text":"","output_ids":%s,"meta_info":{"id":"mine","finish_reason":%s}}' % (
        str(ids).replace(" ", "").encode(), b"null" if finish is None else b'{"type":"length","length":5}')) + b"\n\n"


@pytest.mark.anyio
async def test_the_events_of_one_worker_read_reach_the_client_in_one_write(minted):
    done = {"type": "length", "length": 5}
    reads = [sse(answer([5], None), answer([5, 6], None), answer([5, 6, 7], None)),  # three events, one read
             sse(answer([5, 6, 7, 8], None)),
             sse(answer([5, 6, 7, 8, 9], done)) + b"data: [DONE]\n\n"]
    router = FakeRouter((worker("w0", "sglang", FakePool(FakeResponse(200, reads))),))
    client = Client(SGLangCodec(), STREAM, router)
    await client.run()
    assert RECEIVE_SIZE == 64 * 1024
    bodies = [m["body"] for m in client.messages[1:]]
    assert bodies == [_event([5]) + _event([5, 6]) + _event([5, 6, 7]), _event([5, 6, 7, 8]),
                      _event([5, 6, 7, 8, 9], done) + b"data: [DONE]\n\n"]
