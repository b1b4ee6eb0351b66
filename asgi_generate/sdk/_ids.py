"""Request ids minted by the frontend.

Ids are 32 lowercase hex characters (the shape of SGLang's own uuid4 hex ids):
a random 64-bit prefix per process, so several hypercorn worker processes
never collide (a process forked after this module was imported draws its own),
then a 64-bit counter. Fixed width matters: SGLang's scheduler
aborts every request whose rid *starts with* the aborted rid, so no minted id
may be a prefix of another.
"""

from __future__ import annotations

import itertools
import os
import secrets


def _draw() -> None:
    global _prefix, _counter
    _prefix = secrets.token_hex(8)
    _counter = itertools.count(1)


_draw()
# A fork (a pre-forking server, a fork server) would else mint its parent's ids.
os.register_at_fork(after_in_child=_draw)


def mint() -> str:
    """A new process-unique, fixed-width id (32 hex characters)."""
    return f"{_prefix}{next(_counter):016x}"
