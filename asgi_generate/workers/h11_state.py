"""h11's connection state machine without a ``set`` per connection.

h11 (``h11/_state.py``) keeps the client's protocol-switch proposals
(Upgrade, CONNECT) in a ``set`` made per connection and again per response,
about 430 bytes of every open stream on each side of the frontend: the
server side (hypercorn's h11 connection, :mod:`asgi_generate.server.hypercorn.fixes`)
and the worker client (:mod:`asgi_generate.workers.http`).
"""

from __future__ import annotations

import h11
from h11._state import ConnectionState

#: The empty set of switch proposals every :class:`LeanConnectionState` starts with.
_NO_PROPOSALS: frozenset = frozenset()


class LeanConnectionState(ConnectionState):
    """h11's connection state machine keeping the client's protocol-switch
    proposals in a frozenset, the empty one shared."""

    @property
    def pending_switch_proposals(self) -> frozenset:
        return self._proposals

    @pending_switch_proposals.setter
    def pending_switch_proposals(self, proposals) -> None:
        self._proposals = frozenset(proposals) if proposals else _NO_PROPOSALS

    def process_client_switch_proposal(self, switch_event) -> None:
        self._proposals = self._proposals | {switch_event}
        self._fire_state_triggered_transitions()


def client_connection() -> h11.Connection:
    """A new ``h11.Connection(h11.CLIENT)`` on a :class:`LeanConnectionState`
    (both sides still ``IDLE``: nothing has read the state it replaces)."""
    conn = h11.Connection(h11.CLIENT)
    conn._cstate = LeanConnectionState()
    return conn
