"""Sibling processes' metrics made current for a scrape: the ask and the
answer, in one process standing for several (its process id faked)."""

from __future__ import annotations

import os
import time

import anyio
import pytest

from asgi_generate.ops import siblings


@pytest.fixture(params=["trio", "asyncio"])
def anyio_backend(request):
    return request.param


@pytest.mark.anyio
async def test_an_ask_waits_for_each_sibling_to_refresh_and_the_answerer_leaves_no_file(tmp_path, monkeypatch):
    folder = str(tmp_path)
    refreshed = []
    async with anyio.create_task_group() as tg:
        for pid in (101, 102):
            monkeypatch.setattr(siblings.os, "getpid", lambda pid=pid: pid)
            await tg.start(siblings.answer, folder, lambda pid=pid: refreshed.append(pid))
        assert sorted(os.listdir(folder)) == ["flush_101", "flush_102"]
        monkeypatch.setattr(siblings.os, "getpid", lambda: 101)  # the scraped process asks the other
        await siblings.ask(folder)
        assert refreshed == [102]
        tg.cancel_scope.cancel()
    assert os.listdir(folder) == []


@pytest.mark.anyio
async def test_a_gone_or_stuck_sibling_delays_a_scrape_at_most_the_timeout(tmp_path, monkeypatch):
    folder = str(tmp_path)
    open(os.path.join(folder, "flush_201"), "wb").close()  # killed: nothing listens
    stuck = await anyio.create_unix_listener(siblings.address(folder, 202))
    open(os.path.join(folder, "flush_202"), "wb").close()  # listens, never answers
    monkeypatch.setattr(siblings.os, "getpid", lambda: 200)
    async with stuck:
        started = time.monotonic()
        with anyio.fail_after(30):  # not waiting for ever on the stuck one
            await siblings.ask(folder, timeout=0.3)
        assert time.monotonic() - started > 0.25


@pytest.mark.anyio
async def test_a_message_told_reaches_every_sibling_once_and_an_ask_still_refreshes(tmp_path, monkeypatch):
    folder = str(tmp_path)
    got: list = []
    refreshed: list = []
    async with anyio.create_task_group() as tg:
        for pid in (301, 302, 303):
            monkeypatch.setattr(siblings.os, "getpid", lambda pid=pid: pid)
            await tg.start(siblings.answer, folder, lambda pid=pid: refreshed.append(pid),
                           lambda message, pid=pid: got.append((pid, message)))
        monkeypatch.setattr(siblings.os, "getpid", lambda: 301)  # the process that took the call tells
        message = {"kind": "fence", "protocol": "sglang", "version": "v2", "workers": [{"url": "http://w", "x": 1}]}
        await siblings.tell(folder, message)
        assert sorted(got, key=lambda g: g[0]) == [(302, message), (303, message)] and refreshed == []
        await siblings.ask(folder)
        assert sorted(refreshed) == [302, 303] and len(got) == 2
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_a_message_over_the_bound_is_refused(tmp_path):
    with pytest.raises(ValueError, match="at most"):
        await siblings.tell(str(tmp_path), {"x": "y" * siblings.MAX_MESSAGE})
