"""The request and leg state machine (asgi_generate.request.state): every
allowed transition, every forbidden one refused, the derivation of a batch
item's state, and that nothing else in the request package assigns an
ending or an outcome."""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest

from asgi_generate.request import state
from asgi_generate.request.state import (
    CUTS, ITEM_ENDING, ITEM_FIELDS, LEG_TRANSITIONS, MOVE_TRANSITIONS, REQUEST_ONLY, REQUEST_TRANSITIONS,
    IllegalTransition, Moves,
)
from asgi_generate.tracing.state import LegRecord
from asgi_generate.tracing.schema import ATTEMPT_OUTCOMES, STATUSES
from asgi_generate.tracing.state import RequestState

REQUEST_PACKAGE = pathlib.Path(state.__file__).parent


def ended(status: str | None) -> RequestState:
    st = RequestState("r" * 32, "sglang", "/generate", "POST")
    if status is not None:
        end_as(st, status)
    assert st.status == status
    return st


def end_as(st: RequestState, status: str) -> None:
    """What a call site does to end ``st`` as ``status``: a cut replaces,
    anything else is recorded unless an ending was."""
    if status == "client_disconnect":
        state.client_left(st)
    elif status in CUTS:
        state.cut(st, status, 503, status, "cut")
    elif status == "ok":
        state.finish_ok(st)
    else:
        state.fail(st, status, 500, "engine", "failed")


def test_the_table_names_every_status_and_outcome():
    assert set(REQUEST_TRANSITIONS) == {None, *STATUSES}
    assert set().union(*REQUEST_TRANSITIONS.values()) <= set(STATUSES)
    assert REQUEST_TRANSITIONS[None] == set(STATUSES)
    assert set(LEG_TRANSITIONS) == {None, *ATTEMPT_OUTCOMES}
    assert set().union(*LEG_TRANSITIONS.values()) <= set(ATTEMPT_OUTCOMES)
    assert LEG_TRANSITIONS[None] == set(ATTEMPT_OUTCOMES)


@pytest.mark.parametrize("before", [None, *STATUSES])
@pytest.mark.parametrize("after", STATUSES)
def test_every_request_transition(before, after):
    st = ended(before)
    if after in REQUEST_TRANSITIONS[before]:
        end_as(st, after)
        assert st.status == after
    elif after in CUTS:  # a cut where the table forbids it is a bug
        with pytest.raises(IllegalTransition):
            end_as(st, after)
    else:  # the first ending recorded wins
        end_as(st, after)
        assert st.status == before


def test_a_client_leaving_keeps_the_failure_it_cut_and_a_cut_replaces_it():
    st = ended(None)
    state.fail(st, "rejected", 400, "invalid_request", "bad")
    state.client_left(st)
    assert (st.status, st.http_status, st.error_type, st.error_message) == (
        "client_disconnect", 400, "invalid_request", "bad")
    state.cut(st, "slow_client", 200, "slow_client", "untaken")
    assert (st.status, st.http_status, st.error_type, st.error_message) == (
        "slow_client", 200, "slow_client", "untaken")


def test_end_records_a_status_alone_only_while_running():
    st = ended(None)
    st.http_status = 200
    state.end(st, "client_disconnect")
    state.end(st, "shutdown")
    assert (st.status, st.http_status, st.error_type) == ("client_disconnect", 200, None)


@pytest.mark.parametrize("misuse", [
    lambda st: state.fail(st, "ok", 200, None, None),
    lambda st: state.fail(st, "done", 200, None, None),
    lambda st: state.end(st, "ok"),
    lambda st: state.cut(st, "engine_error", 502, "engine", "m"),
])
def test_an_ending_the_machine_does_not_know_is_refused(misuse):
    with pytest.raises(IllegalTransition):
        misuse(ended(None))


@pytest.mark.parametrize("before", [None, *ATTEMPT_OUTCOMES])
@pytest.mark.parametrize("after", [o for o in ATTEMPT_OUTCOMES if o != "aborted"])
def test_every_leg_transition(before, after):
    attempt = LegRecord("a" * 32, outcome=before)
    if after in LEG_TRANSITIONS[before] or after == before:
        state.end_leg(attempt, after)
        assert attempt.outcome == after
    else:
        with pytest.raises(IllegalTransition):
            state.end_leg(attempt, after)


@pytest.mark.parametrize("before", [None, *ATTEMPT_OUTCOMES])
@pytest.mark.parametrize("lost", [False, True])
def test_an_abort_answer_records_only_an_unknown_end(before, lost):
    attempt = LegRecord("a" * 32, outcome=before)
    state.abort_answered(attempt, lost)
    assert attempt.outcome == (before or ("worker_lost" if lost else "aborted"))


def _request_with_every_field_set() -> RequestState:
    """A request state whose every field holds a value of its own."""
    st = ended(None)
    for f in dataclasses.fields(RequestState):
        setattr(st, f.name, object())
    return st


def test_an_item_has_every_field_of_its_request_but_its_own():
    st = _request_with_every_field_set()
    own = {name: object() for name in ITEM_FIELDS}
    item = state.item_state(st, False, None, **own)
    defaults = RequestState("i" * 32, "f", "/r", "POST")
    names = {f.name for f in dataclasses.fields(RequestState)}
    assert ITEM_FIELDS | ITEM_ENDING | REQUEST_ONLY <= names
    for name in names:
        if name in ITEM_FIELDS:
            assert getattr(item, name) is own[name], name
        elif name in REQUEST_ONLY:
            assert getattr(item, name) == getattr(defaults, name), name
        else:  # the request's, its ending included (the item was not answered)
            assert getattr(item, name) is getattr(st, name), name


def test_a_field_added_to_the_state_reaches_its_items():
    @dataclasses.dataclass(slots=True)
    class Grown(RequestState):
        added_later: str | None = None

    st = Grown("r" * 32, "sglang", "/generate", "POST", added_later="kept")
    state.fail(st, "client_disconnect", 200, None, None)
    item = state.item_state(st, False, None, **{name: None for name in ITEM_FIELDS})
    assert item.added_later == "kept"


@pytest.mark.parametrize("answered, error, ending", [
    (True, None, ("ok", 200, None, None)),
    (True, "boom", ("engine_error", 200, "engine", "boom")),
    (False, "boom", ("engine_error", 200, "engine", "boom")),
    (False, None, ("client_disconnect", 200, "engine", "cut")),
])
def test_an_items_ending(answered, error, ending):
    st = ended(None)
    state.fail(st, "client_disconnect", 200, "engine", "cut")
    item = state.item_state(st, answered, error, **{name: None for name in ITEM_FIELDS})
    assert (item.status, item.http_status, item.error_type, item.error_message) == ending


def test_an_item_needs_exactly_its_own_fields():
    own = {name: None for name in ITEM_FIELDS}
    with pytest.raises(TypeError):
        state.item_state(ended("ok"), True, None, **{**own, "model": "m"})
    own.pop("attempts")
    with pytest.raises(TypeError):
        state.item_state(ended("ok"), True, None, **own)


def _assigned_attributes() -> list[tuple[str, ast.Attribute]]:
    """``(file name, attribute)`` of every attribute assigned to in the
    request package outside state.py."""
    found = []
    for path in sorted(REQUEST_PACKAGE.glob("*.py")):
        if path.name == "state.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            found += [(path.name, t) for target in targets for t in ast.walk(target) if isinstance(t, ast.Attribute)]
    return found


def test_only_the_state_machine_assigns_an_ending_or_an_outcome():
    watched = {"status", "error_type", "error_message", "outcome"}
    found = [f"{name}:{t.lineno} {t.attr}" for name, t in _assigned_attributes() if t.attr in watched]
    assert found == []


#: The move transitions, by the phase each leads to.
MOVES_TO = {
    state.CONTINUING: state.migrate,
    state.HELD: state.hold_for_pause,
    state.AFTER_PAUSE: lambda moves: state.resume_after_pause(moves, ended(None)),
    state.GIVEN_UP: state.give_up_hold,
}


@pytest.mark.parametrize("before", list(MOVE_TRANSITIONS))
@pytest.mark.parametrize("after", list(MOVES_TO))
def test_every_move_transition(before, after):
    moves = Moves("r" * 32, phase=before)
    if after in MOVE_TRANSITIONS[before]:
        MOVES_TO[after](moves)
        assert moves.phase == after
    else:
        with pytest.raises(IllegalTransition):
            MOVES_TO[after](moves)


def test_a_request_held_across_a_pause_continues_unbounded_then_as_any_migration():
    st = ended(None)
    moves = Moves("r" * 32, pause_epoch=0)
    assert (moves.continuing, state.next_role(moves, st, True)) == (False, "aggregated")
    state.hold_for_pause(moves)
    assert (moves.held, moves.continuing) == (True, False)
    state.resume_after_pause(moves, st)
    assert (moves.after_pause, moves.continuing, moves.bounded, st.pause_resumes) == (True, True, False, 1)
    state.planned(moves)
    assert (moves.phase, moves.bounded) == (state.CONTINUING, True)
    assert [state.next_role(moves, st, True), state.next_role(moves, st, False)] == ["resumed", "replayed"]
    assert (st.migrations, st.replays) == (1, 1)


def test_only_the_state_machine_moves_a_request_or_counts_its_moves():
    counters = {"migrations", "replays", "pause_resumes"}
    found = []
    for name, t in _assigned_attributes():
        owner = t.value.attr if isinstance(t.value, ast.Attribute) else getattr(t.value, "id", None)
        if t.attr in counters or (t.attr == "phase" and owner == "moves"):
            found.append(f"{name}:{t.lineno} {t.attr}")
    assert found == []
