"""A hypercorn that differs from the one the patches were written against,
for a whole process: :func:`environment` gives the variables under which a
Python process starts with :data:`MISMATCHES`' change applied (a
``sitecustomize`` that calls :func:`apply`), before anything of ours runs.
Each change leaves stock hypercorn working, so what the server does shows
what :func:`asgi_generate.server.hypercorn.patches.install` did about it."""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
from collections.abc import Callable


def _missing_target(set_attr: Callable, del_attr: Callable) -> None:
    # Stock hypercorn's trio TCPServer took its own reference at import.
    import hypercorn.trio.run  # noqa: F401
    import hypercorn.trio.worker_context as worker_context

    del_attr(worker_context, "TrioSingleTask")


def _changed_signature(set_attr: Callable, del_attr: Callable) -> None:
    from hypercorn.protocol.h11 import H11Protocol

    original = H11Protocol._send_h11_event

    async def _send_h11_event(self, event, *, flush=True):
        await original(self, event)

    set_attr(H11Protocol, "_send_h11_event", _send_h11_event)


def _other_release(set_attr: Callable, del_attr: Callable) -> None:
    version = importlib.metadata.version
    set_attr(importlib.metadata, "version", lambda name: "0.19.0" if name.lower() == "hypercorn" else version(name))


#: Each change, by name, and how the patches' check names it.
MISMATCHES = {
    "missing": (_missing_target, "hypercorn.trio.worker_context.TrioSingleTask is missing"),
    "signature": (_changed_signature, "hypercorn.protocol.h11.H11Protocol._send_h11_event takes "
                                      "(self, event, *, flush), expected (self, event)"),
    "version": (_other_release, "hypercorn 0.19.0 is installed, not >=0.18,<0.19"),
}


def apply(kind: str, set_attr: Callable = setattr, del_attr: Callable = delattr) -> None:
    """Make the change ``kind`` (a key of :data:`MISMATCHES`) in this
    process, through ``set_attr`` and ``del_attr`` (pytest's monkeypatch's,
    to have it undone)."""
    MISMATCHES[kind][0](set_attr, del_attr)


def environment(kind: str, folder: pathlib.Path) -> dict[str, str]:
    """Variables under which a Python process applies ``kind`` as it starts
    (its ``sitecustomize`` is written to ``folder``)."""
    (folder / "sitecustomize.py").write_text(f"import hypercorn_mismatch\nhypercorn_mismatch.apply({kind!r})\n")
    here = str(pathlib.Path(__file__).resolve().parent)
    path = os.pathsep.join(p for p in (str(folder), here, os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path}
