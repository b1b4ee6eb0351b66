"""The state machine of one request and of its engine legs: the only code
that changes a request's ending (``status`` and its error) or an attempt's
``outcome``, in the spirit of h11's ``_state.py`` for connections.

A request (:class:`~asgi_generate.tracing.state.RequestState`) runs with
``status`` ``None``; call sites say what happened:

- :func:`finish_ok`, :func:`fail` and :func:`end` record an ending. The
  first ending recorded wins: a later one is the consequence of the first
  (the error answer of a request that already failed, a write to a client
  that is gone) and changes nothing.
- :func:`client_left` and :func:`cut` replace an earlier ending, as
  :data:`REQUEST_TRANSITIONS` allows: the client leaving before its answer
  was complete, a slow client cut off, the shutdown grace running out.

An attempt (:class:`~asgi_generate.sdk.codec.Attempt`) runs with
``outcome`` ``None``: :func:`end_leg` records how its leg ended, as
:data:`LEG_TRANSITIONS` allows; :func:`abort_answered` records the abort's
answer unless the leg's end is known already.

A request with items records one state per item, derived from the
request's by :func:`item_state`.

An illegal transition is a bug: it is logged as an error and warned as
:class:`IllegalTransition` (the test suite turns that warning into an
exception), then done as asked, so that the request still gets its record.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings

from ..sdk.codec import Attempt
from ..tracing.schema import ATTEMPT_OUTCOMES, STATUSES
from ..tracing.state import RequestState

log = logging.getLogger("asgi_generate.request.state")

#: Endings that replace an earlier one: the client left before its answer
#: was complete, a client left a write untaken too long, the shutdown
#: grace ran out before the answer was complete.
CUTS = frozenset({"client_disconnect", "slow_client", "shutdown"})
#: Ending (``None``: running) -> the endings that may replace it. A running
#: request may end any way; a failed one may still be cut; an ``ok`` one
#: only by a slow-client cut-off whose write was the answer's last.
REQUEST_TRANSITIONS: dict[str | None, frozenset[str]] = {
    None: frozenset(STATUSES),
    "ok": frozenset({"slow_client"}),
    **{status: CUTS for status in STATUSES if status != "ok"},
}
#: Outcome (``None``: running) -> the outcomes that may replace it. A leg
#: that ended may be judged once more: a batch leg whose items all finished
#: reads on until its stream ends, so its connection may yet break (error,
#: or its worker lost); a leg whose worker was lost mid-answer is finished
#: (or failed) by what its codec held. Recording the same outcome again
#: changes nothing and is always allowed.
LEG_TRANSITIONS: dict[str | None, frozenset[str]] = {
    None: frozenset(ATTEMPT_OUTCOMES),
    "finished": frozenset({"error", "worker_lost"}),
    "worker_lost": frozenset({"finished", "error"}),
    **{outcome: frozenset() for outcome in ATTEMPT_OUTCOMES if outcome not in ("finished", "worker_lost")},
}

#: The normalized finish reason of an answer its engine cut short by its own
#: abort: SGLang's ``{"type": "abort", ...}`` (``FINISH_ABORT`` in
#: sglang/srt/managers/schedule_batch.py), vLLM's ``"abort"``
#: (``FinishReason.ABORT`` in vllm/v1/engine/__init__.py).
ABORT = "abort"
#: The record's error message of an ``engine_abort`` ending.
ENGINE_ABORT_MESSAGE = "the engine aborted the request (finish_reason abort): its output is truncated"

#: An item's own fields (:func:`item_state`): the caller gives them from
#: the item and its tally; every other field but :data:`ITEM_ENDING` and
#: :data:`REQUEST_ONLY` is the request's.
ITEM_FIELDS = frozenset({
    "request_id", "public_id", "input_ids", "input_length", "replay_excluded",
    "batch_id", "batch_index", "batch_size", "attempts",
    "finish_reason", "finish_matched", "output_tokens", "prompt_tokens", "engine_completion_tokens",
    "cached_tokens", "t_first_token", "t_last_token",
})
#: An item's ending, decided by :func:`item_state`.
ITEM_ENDING = frozenset({"status", "error_type", "error_message"})
#: The request's as a whole, never an item's: every item's output ids in
#: arrival order, its OpenTelemetry trace context, its body bytes (counted
#: once), its items' expansion and count. An item has the field's default.
REQUEST_ONLY = frozenset({"output_ids", "trace", "body_bytes", "expand", "item_count"})


class IllegalTransition(UserWarning):
    """A request's ending or an attempt's outcome was changed against
    :data:`REQUEST_TRANSITIONS` or :data:`LEG_TRANSITIONS`: a bug."""


def _illegal(what: str) -> None:
    log.error("illegal transition: %s", what)
    warnings.warn(what, IllegalTransition, stacklevel=3)


def _replace(st: RequestState, status: str) -> None:
    if status not in REQUEST_TRANSITIONS[st.status]:
        _illegal(f"request {st.request_id}: {st.status} -> {status}")


def finish_ok(st: RequestState) -> None:
    """The client was sent its whole answer: ``ok``, unless an ending was
    recorded before (e.g. an engine error the answer carried)."""
    if st.status is None:
        st.status = "ok"


def fail(st: RequestState, status: str, http_status: int | None, error_type: str | None,
         message: str | None) -> None:
    """Record a failed ending (``status``, the answer's HTTP status, the
    record's ``error`` type and message), unless an ending was recorded
    before: the first failure wins."""
    if status == "ok" or status not in STATUSES:
        _illegal(f"request {st.request_id}: fail as {status!r}")
    if st.status is None:
        st.status = status
        st.http_status = http_status
        st.error_type = error_type
        st.error_message = message


def engine_abort(st: RequestState) -> None:
    """The answer ended with the engine's abort (its finish reason
    :data:`ABORT`: a pause without hold, ``abort_all``): ``engine_abort``,
    its output truncated, unless an ending was recorded before (e.g. the
    client left, and the abort was the frontend's own)."""
    fail(st, "engine_abort", st.http_status, "engine_abort", ENGINE_ABORT_MESSAGE)


def end(st: RequestState, status: str) -> None:
    """Record ``status`` alone (``client_disconnect``: a write found the
    client gone; ``shutdown``: the request was cancelled from outside),
    unless an ending was recorded before."""
    if status not in CUTS:
        _illegal(f"request {st.request_id}: end as {status!r}")
    if st.status is None:
        st.status = status


def client_left(st: RequestState) -> None:
    """The client went away before its answer was complete (or while its
    error answer was written): ``client_disconnect`` replaces any failure
    recorded before, keeping its HTTP status and error."""
    _replace(st, "client_disconnect")
    st.status = "client_disconnect"


def cut(st: RequestState, status: str, http_status: int | None, error_type: str, message: str) -> None:
    """End the request as ``status`` (``slow_client`` or ``shutdown``),
    replacing any ending recorded before, with the answer's HTTP status and
    the record's error."""
    if status not in CUTS:
        _illegal(f"request {st.request_id}: cut as {status!r}")
    _replace(st, status)
    st.status = status
    st.http_status = http_status
    st.error_type = error_type
    st.error_message = message


def end_leg(attempt: Attempt, outcome: str) -> None:
    """Record how ``attempt``'s leg ended (``finished``, ``error``,
    ``connect_failed``, ``worker_lost``, ``timeout``)."""
    if outcome != attempt.outcome and outcome not in LEG_TRANSITIONS[attempt.outcome]:
        _illegal(f"attempt {attempt.engine_id}: {attempt.outcome} -> {outcome}")
    attempt.outcome = outcome


def abort_answered(attempt: Attempt, lost: bool) -> None:
    """The abort of ``attempt``'s leg was answered: ``worker_lost`` if its
    worker was gone (``lost``), else ``aborted``; a leg whose end was
    recorded before keeps it."""
    if attempt.outcome is None:
        attempt.outcome = "worker_lost" if lost else "aborted"


def item_state(st: RequestState, answered: bool, error: str | None, **own) -> RequestState:
    """The finished state of one item of the request ``st``: every field of
    ``st``, but the item's own (``own``, exactly :data:`ITEM_FIELDS`), the
    defaults of :data:`REQUEST_ONLY`, and its ending: ``engine_error`` with
    ``error`` when its engine reported one that counts for the item, else,
    when the item was ``answered`` (its finish reached the client),
    ``engine_abort`` if that finish was the engine's abort and ``ok``
    otherwise, else the request's ending.

    Raises:
        TypeError: ``own`` is not exactly :data:`ITEM_FIELDS`.
    """
    if own.keys() != ITEM_FIELDS:
        raise TypeError(f"an item's own fields are {sorted(ITEM_FIELDS)}, not {sorted(own)}")
    if error is not None:
        own.update(status="engine_error", error_type="engine", error_message=error)
    elif answered and own["finish_reason"] == ABORT:
        own.update(status="engine_abort", error_type="engine_abort", error_message=ENGINE_ABORT_MESSAGE)
    elif answered:
        own.update(status="ok", error_type=None, error_message=None)
    for f in dataclasses.fields(RequestState):
        if f.name in REQUEST_ONLY:
            own[f.name] = f.default_factory() if f.default is dataclasses.MISSING else f.default
    return dataclasses.replace(st, **own)
