"""Aborting a request's engine legs: every leg that may still run, each
asked of its worker's engine concurrently, the answer recorded on its
attempt (:func:`asgi_generate.request.state.abort_answered`). A batch leg
whose engine runs each item under an id of its own aborts each unfinished
item by that id (:mod:`asgi_generate.request.batches`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio

from . import state
from ..tracing.state import LegRecord, RequestState
from ..workers.aborts import ACKED, LOST

if TYPE_CHECKING:
    from .context import RequestContext



async def abort_live_legs(ctx: "RequestContext", st: RequestState) -> None:
    """Abort every engine leg of ``st`` that may still run, concurrently,
    recording on each attempt whether the engine acknowledged."""
    live = [a for a in st.attempts if a.live]
    if len(live) == 1:  # the common case needs no task group
        await _abort_leg(ctx, live[0])
        return
    if not live:
        return
    async with anyio.create_task_group() as tg:
        for attempt in live:
            tg.start_soon(_abort_leg, ctx, attempt)


async def _abort_leg(ctx: "RequestContext", attempt: LegRecord) -> None:
    attempt.live = False
    if attempt.entry_ids is not None:  # a batch leg: each unfinished item by its own id
        await _abort_entries(ctx, attempt)
        return
    # A worker marked down (dead, or given up by its probe) gets no abort:
    # the queue answers "lost" at once, so the record is not held up.
    result = await ctx.abort_engine_request(attempt.worker, attempt.engine_id)
    attempt.abort_acked = result == ACKED
    state.abort_answered(attempt, result == LOST)


async def _abort_entries(ctx: "RequestContext", attempt: LegRecord) -> None:
    acked: dict[int, bool] = {}
    results: dict[int, str] = {}

    async def one(j: int) -> None:
        results[j] = await ctx.abort_engine_request(attempt.worker, attempt.entry_ids[j])
        acked[j] = results[j] == ACKED

    async with anyio.create_task_group() as tg:
        for j in sorted(attempt.unfinished or ()):
            tg.start_soon(one, j)
    attempt.entry_acked = acked
    attempt.abort_acked = all(acked.values())
    state.abort_answered(attempt, LOST in results.values())
