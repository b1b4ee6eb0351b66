"""Request ids minted by the frontend.

Ids are 32 lowercase hex characters (the shape of SGLang's own uuid4 hex ids):
a random 64-bit prefix per process, so several hypercorn worker processes
never collide, then a 64-bit counter. Fixed width matters: SGLang's scheduler
aborts every request whose rid *starts with* the aborted rid, so no minted id
may be a prefix of another.
"""

from __future__ import annotations

import itertools
import secrets

_prefix = secrets.token_hex(8)
_counter = itertools.count(1)


def mint() -> str:
    """A new process-unique, fixed-width id (32 hex characters)."""
    return f"{_prefix}{next(_counter):016x}"
