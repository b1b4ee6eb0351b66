"""Where serialized trace records go: a size-rotated JSONL file per server
process, and stderr (OTLP spans and log records: :mod:`.otlp`).

A sink receives a batch as one ``bytes`` of complete JSONL lines and writes
it from the trace writer's worker thread, never from the event loop, so a
slow disk or a blocked pipe never stalls a response.
"""

from __future__ import annotations

import os
import pathlib
import time


class Sink:
    """A destination for JSONL batches.

    Attributes:
        name: ``file`` or ``stderr``, as ``/stats`` shows it.
        written: records written.
        failed: records lost to write errors.
    """

    name = ""
    #: Takes built records (:meth:`write_records`) rather than JSONL bytes.
    takes_records = False

    def __init__(self) -> None:
        self.written = 0
        self.failed = 0

    def open(self) -> None:
        """Get ready to write (in the serving process).

        Raises:
            OSError: the destination cannot be opened.
        """

    def write(self, data: bytes) -> None:
        """Write ``data``, complete JSONL lines.

        Raises:
            OSError: the write failed; nothing is retried.
        """
        raise NotImplementedError

    def write_records(self, batch: list) -> None:
        """Write ``batch``, ``(RequestState, record, JSON line)`` triples
        (only when :attr:`takes_records`).

        Raises:
            OSError: the write failed; nothing is retried.
        """
        raise NotImplementedError

    def close(self) -> None:
        """Flush and release the destination."""

    def describe(self) -> dict:
        """Counters for ``/stats``."""
        return {"written": self.written, "failed": self.failed}


class JsonlFileSink(Sink):
    """Append-only JSONL files ``<base>.<pid>.<start>.<n>.jsonl``.

    ``<base>`` is the configured path without a ``.jsonl`` suffix, ``<pid>``
    the serving process (so hypercorn worker processes never share a file),
    ``<start>`` its start time (Unix seconds, so a reused pid starts new
    files) and ``<n>`` counts rotations from ``0000``. A new file begins
    once the current one holds ``rotate_bytes`` (0: never rotate); a batch
    is never split across files.

    Args:
        path: the configured ``--trace-file``; its directory must exist.
        rotate_bytes: the size that triggers rotation.
    """

    name = "file"

    def __init__(self, path: str, rotate_bytes: int) -> None:
        super().__init__()
        self.base = path[: -len(".jsonl")] if path.endswith(".jsonl") else path
        self.rotate_bytes = rotate_bytes
        self.index = 0
        self.size = 0
        self.path: pathlib.Path | None = None
        self._file = None
        self._stem = ""

    def open(self) -> None:
        """Open the first file of this process."""
        self._stem = f"{self.base}.{os.getpid()}.{int(time.time())}"
        self._open()

    def _open(self) -> None:
        self.path = pathlib.Path(f"{self._stem}.{self.index:04d}.jsonl")
        self._file = open(self.path, "ab+")
        self.size = self._file.seek(0, os.SEEK_END)
        if self.size:
            self._file.seek(-1, os.SEEK_END)
            if self._file.read(1) != b"\n":  # a failed write left half a line: end it
                self._file.write(b"\n")
                self.size += 1

    def write(self, data: bytes) -> None:
        """Append ``data`` and flush it; once the file is full, the next
        batch starts the next file. After a failure the next batch reopens
        the file, first ending any half-written line so later records stay
        whole."""
        if self._file is None:
            self._open()
        try:
            self._file.write(data)
            self._file.flush()
        except OSError:
            self._drop_file()
            raise
        self.size += len(data)
        if self.rotate_bytes and self.size >= self.rotate_bytes:
            self._drop_file()
            self.index += 1

    def _drop_file(self) -> None:
        try:
            self._file.close()
        except OSError:
            pass
        self._file = None

    def close(self) -> None:
        """Close the current file."""
        if self._file is not None:
            self._drop_file()

    def describe(self) -> dict:
        """Counters plus the current file and the rotation index."""
        return {**super().describe(), "path": str(self.path) if self.path else None, "rotations": self.index}


class StderrSink(Sink):
    """The process's standard error, written with ``os.write`` on fd 2 so a
    batch goes out as whole lines, not interleaved through Python's buffers."""

    name = "stderr"

    def write(self, data: bytes) -> None:
        """Write all of ``data`` to fd 2."""
        view = memoryview(data)
        while view:
            view = view[os.write(2, view) :]
