"""Imported once by each fork server, last of ``forked.PRELOAD``, never by a
test: the work every ``sim`` and ``serve`` repeats as it starts, whatever
its arguments, done once before the forks (~35 ms of CPU a start). A child
is then what a process is that did it already: it loaded the engine
descriptions from the same installed distributions (the fork server's
``sys.path``, which :func:`forked.can_fork` holds equal), and checked the
same hypercorn against the patches, which it installs again with its own
arguments (:func:`asgi_generate.server.hypercorn.patches.install` only
chooses them again). What fails here is left for the child to fail on and
report as it would."""

import contextlib

from asgi_generate.protocols import PROTOCOLS
from asgi_generate.server.hypercorn import patches

with contextlib.suppress(Exception):
    list(PROTOCOLS)
with contextlib.suppress(Exception):
    patches.install(send_errors=False)
