"""``asgi-generate`` under tracemalloc, for bench_streams.py --profile.

Run as ``python bench/_traced.py serve ...``. SIGUSR2 takes the baseline
snapshot; SIGUSR1 writes what was allocated since, as JSON to the file named
by ``TRACED_OUT``: one row per allocating source line and *owner*, the
nearest caller in asgi-generate (a codec or a module of the core, not the
launcher that starts hypercorn), else in hypercorn, else the library that
allocated; with the bytes of each whole call stack under ``stacks``, for
reading where a row's memory comes from.
"""

from __future__ import annotations

import os
import signal
import sys
import tracemalloc

import orjson

tracemalloc.start(10)
_base: list[tracemalloc.Snapshot] = []


def _baseline(*_: object) -> None:
    _base[:] = [tracemalloc.take_snapshot()]


#: Our modules that only start hypercorn: what it allocates below them is its own.
_LAUNCHERS = ("/asgi_generate/server/serving.py", "/asgi_generate/server/cli.py", "/asgi_generate/__main__.py")


def _owner(tb: tracemalloc.Traceback) -> str:
    for frame in reversed(tb):  # most recent first
        name = frame.filename
        if name.endswith(_LAUNCHERS):
            break
        if "/asgi_generate_" in name:
            return "asgi-generate: " + name.split("/asgi_generate_", 1)[1].split("/", 1)[0] + " codec"
        if "/asgi_generate/" in name:
            return "asgi-generate: " + name.split("/asgi_generate/", 1)[1]
    for frame in reversed(tb):
        if "/hypercorn/" in frame.filename:
            return "hypercorn"
    return "other: " + (os.path.basename(os.path.dirname(tb[-1].filename)) or tb[-1].filename)


def _dump(*_: object) -> None:
    snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
    diff = snap.compare_to(_base[0], "traceback") if _base else snap.statistics("traceback")
    rows: dict[tuple[str, str], list] = {}
    for s in diff:
        where = f"{s.traceback[-1].filename}:{s.traceback[-1].lineno}"
        acc = rows.setdefault((_owner(s.traceback), where), [0, 0, {}])
        size = s.size_diff if _base else s.size
        acc[0] += size
        acc[1] += s.count_diff if _base else s.count
        stack = " < ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}" for f in reversed(s.traceback))
        acc[2][stack] = acc[2].get(stack, 0) + size
    out = [{"owner": o, "where": w, "bytes": b, "count": c, "stacks": st} for (o, w), (b, c, st) in rows.items()]
    target = os.environ["TRACED_OUT"]
    with open(target + ".part", "wb") as f:
        f.write(orjson.dumps(out))
    os.replace(target + ".part", target)  # whole or absent


signal.signal(signal.SIGUSR2, _baseline)
signal.signal(signal.SIGUSR1, _dump)

from asgi_generate.server.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
