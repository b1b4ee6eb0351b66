"""What the patches count at the edge of a connection, in this process:
read by ``/stats`` (``connections_closed``,
:meth:`asgi_generate.server.app.App.stats`) and ``/metrics``
(``asgi_generate_connections_closed_total``). A module of its own, with no
hypercorn import, so the app can read it when the patches did not install
(then everything stays 0)."""

from __future__ import annotations

#: Connections closed before a request reached the app, by reason:
#: ``ambiguous_framing``, a request head refused for its framing
#: (:func:`asgi_generate.server.hypercorn.fixes.framing_problem`: 400 or
#: 501); ``header_timeout``, a request head not complete at its deadline
#: (``--header-read-timeout``: 408, or no answer when none of it came or
#: the socket has no room for one).
closed: dict[str, int] = {"ambiguous_framing": 0, "header_timeout": 0}
