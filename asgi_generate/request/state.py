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

An attempt (:class:`~asgi_generate.tracing.state.LegRecord`) runs with
``outcome`` ``None``: :func:`end_leg` records how its leg ended, as
:data:`LEG_TRANSITIONS` allows; :func:`abort_answered` records the abort's
answer unless the leg's end is known already.

A request with items records one state per item, derived from the
request's by :func:`item_state`.

Where a request's answer goes on after a leg failed mid-answer or its
fleet paused is its :class:`Moves`, whose ``phase`` changes as
:data:`MOVE_TRANSITIONS` allows: :func:`migrate`, :func:`hold_for_pause`,
:func:`resume_after_pause`, :func:`give_up_hold` and :func:`planned`;
:func:`next_role` names (and counts) the next attempt.

An illegal transition is a bug: it is logged as an error and warned as
:class:`IllegalTransition` (the test suite turns that warning into an
exception), then done as asked, so that the request still gets its record.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from dataclasses import dataclass

from ..tracing.schema import ATTEMPT_OUTCOMES, STATUSES
from ..tracing.state import LegRecord, RequestState

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
    """A request's ending, an attempt's outcome or a request's move phase
    was changed against :data:`REQUEST_TRANSITIONS`,
    :data:`LEG_TRANSITIONS` or :data:`MOVE_TRANSITIONS`: a bug."""


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


def end_leg(attempt: LegRecord, outcome: str) -> None:
    """Record how ``attempt``'s leg ended (``finished``, ``error``,
    ``connect_failed``, ``worker_lost``, ``timeout``)."""
    if outcome != attempt.outcome and outcome not in LEG_TRANSITIONS[attempt.outcome]:
        _illegal(f"attempt {attempt.engine_id}: {attempt.outcome} -> {outcome}")
    attempt.outcome = outcome


def abort_answered(attempt: LegRecord, lost: bool) -> None:
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


#: The first attempt runs, or a failover of it (nothing of the answer moved).
FIRST = "first"
#: An attempt failed mid-answer: every later attempt continues the answer
#: (``resumed``, or ``replayed`` when unary), each after a backoff and
#: bounded by ``migration_limit``.
CONTINUING = "continuing"
#: A leg ended with the engine's abort of a pause of its fleet: the stream
#: waits for the fleet's resume (:mod:`asgi_generate.workers.pauses`).
HELD = "held"
#: The fleet resumed: the next attempt continues the stream at once (no
#: backoff, not counted against ``migration_limit``).
AFTER_PAUSE = "after_pause"
#: The hold ended without a resume (past ``pause_hold_limit`` or
#: ``pause_hold_timeout``): the request ended with 503.
GIVEN_UP = "given_up"
#: Move phase -> the phases it may change to (see :class:`Moves`).
MOVE_TRANSITIONS: dict[str, frozenset[str]] = {
    FIRST: frozenset({CONTINUING, HELD}),
    CONTINUING: frozenset({CONTINUING, HELD}),
    HELD: frozenset({AFTER_PAUSE, GIVEN_UP}),
    AFTER_PAUSE: frozenset({CONTINUING}),
    GIVEN_UP: frozenset(),
}


@dataclass(slots=True)
class Moves:
    """Where one request's answer goes on: its move ``phase`` (one of
    :data:`MOVE_TRANSITIONS`) and the fleet's pause count when its current
    plan was made (``pause_epoch``; ``None`` when the request does not
    resume after a pause). The counts of moves are the record's
    (``RequestState.migrations``, ``replays``, ``pause_resumes``)."""

    request_id: str
    pause_epoch: int | None = None
    phase: str = FIRST

    @property
    def continuing(self) -> bool:
        """The next attempt continues the answer (``resumed`` or ``replayed``)."""
        return self.phase == CONTINUING or self.phase == AFTER_PAUSE

    @property
    def bounded(self) -> bool:
        """The next attempt is a migration's: after a backoff, bounded by
        ``migration_limit`` (a continuation after a pause is neither)."""
        return self.phase == CONTINUING

    @property
    def held(self) -> bool:
        """The last leg ended with a pause's abort, held for the resume."""
        return self.phase == HELD

    @property
    def after_pause(self) -> bool:
        """The fleet resumed: the next attempt continues the held stream."""
        return self.phase == AFTER_PAUSE


def _move(moves: Moves, phase: str) -> None:
    if phase not in MOVE_TRANSITIONS[moves.phase]:
        _illegal(f"request {moves.request_id}: moves {moves.phase} -> {phase}")
    moves.phase = phase


def migrate(moves: Moves) -> None:
    """An attempt failed mid-answer and the request migrates."""
    _move(moves, CONTINUING)


def hold_for_pause(moves: Moves) -> None:
    """A leg ended with a pause's abort: hold the stream for the resume."""
    _move(moves, HELD)


def resume_after_pause(moves: Moves, st: RequestState) -> None:
    """The fleet resumed: the held stream continues (counted in ``st.pause_resumes``)."""
    _move(moves, AFTER_PAUSE)
    st.pause_resumes += 1


def resume_after_preemption(moves: Moves, st: RequestState) -> None:
    """Admission gave a preempted (held) stream its slot back: it continues
    (counted in ``st.preemptions``)."""
    _move(moves, AFTER_PAUSE)
    st.preemptions += 1


def give_up_hold(moves: Moves) -> None:
    """The hold ended without a resume; the request ends with 503."""
    _move(moves, GIVEN_UP)


def planned(moves: Moves) -> None:
    """The next attempt was planned: after a pause, it continues the
    stream, and any later one continues it too."""
    if moves.phase == AFTER_PAUSE:
        _move(moves, CONTINUING)


def next_role(moves: Moves, st: RequestState, stream_resumes: bool) -> str:
    """The next attempt's role, counting it in ``st``: ``resumed`` (a
    stream continues, ``stream_resumes``), ``replayed`` (a unary request
    starts over), else ``aggregated``."""
    if not moves.continuing:
        return "aggregated"
    if not stream_resumes:
        st.replays += 1
        return "replayed"
    st.migrations += 1
    return "resumed"
