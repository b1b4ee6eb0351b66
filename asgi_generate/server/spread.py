"""Keep-alive connections spread evenly over ``serve --workers N``'s processes.

Each process accepts on a socket of its own (``SO_REUSEPORT``,
:func:`asgi_generate.server.serving.port_group`), where the kernel places a
new connection by a hash of its addresses and ports: many short connections
spread evenly, but a few long-lived ones (a load balancer's pool, a load
generator's 32) split as the hash falls, 17/15 or 21/11. So each process
publishes how many client connections it holds in a :class:`Table` shared
with its siblings, and a process holding more than its share (the total
over N, rounded up) asks the client of its next HTTP/1.1 answer to close the
connection after it (``connection: close``, as hypercorn does after
``keep_alive_max_requests``): no answer is cut, the client connects anew for
its next request, and the kernel places that connection anew, until the
split is even. One connection at a time: the next is asked once one has
closed (else answers going out together would all be asked, and the split
overshoot), so a process whose asked connection streams for minutes asks
no other meanwhile. Counting and asking are done by our hypercorn connections
(:mod:`asgi_generate.server.hypercorn.asyncio_serve`,
:mod:`~asgi_generate.server.hypercorn.trio_serve`,
:mod:`~asgi_generate.server.hypercorn.fixes`); stock hypercorn counts nothing.
"""

from __future__ import annotations

import mmap
import os
import struct

#: One process's slot: its open connections, a native signed 64-bit
#: integer; :data:`GONE` once the process is.
SLOT = struct.Struct("q")
GONE = -1


class Table:
    """Open client connections per process, in memory shared by the
    processes of one ``serve --workers N`` (a file the supervisor makes and
    passes to each child by descriptor).

    Args:
        fd: the shared file, at least ``slots`` * 8 bytes.
        slot: this process's slot, 0 to ``slots`` - 1 (the supervisor's
            table uses none: pass 0).
        slots: the number of processes.
    """

    __slots__ = ("fd", "slot", "slots", "open", "_asked", "_map", "_all")

    def __init__(self, fd: int, slot: int, slots: int) -> None:
        self.fd = fd
        self.slot = slot
        self.slots = slots
        #: This process's open connections.
        self.open = 0
        #: A connection was asked to close and none has closed since.
        self._asked = False
        self._map = mmap.mmap(fd, slots * SLOT.size)
        self._all = struct.Struct(f"{slots}q")

    @classmethod
    def create(cls, slots: int) -> "Table":
        """A zeroed table for ``slots`` processes in an anonymous file whose
        descriptor children can inherit (Linux ``memfd_create``; elsewhere
        an unlinked temporary file)."""
        if hasattr(os, "memfd_create"):
            fd = os.memfd_create("asgi-generate-connections", 0)
        else:
            import tempfile

            fd, path = tempfile.mkstemp(prefix="asgi-generate-connections-")
            os.unlink(path)
        os.ftruncate(fd, slots * SLOT.size)
        os.set_inheritable(fd, True)
        return cls(fd, 0, slots)

    def opened(self) -> None:
        """One more client connection in this process."""
        self.open += 1
        SLOT.pack_into(self._map, self.slot * SLOT.size, self.open)

    def closed(self) -> None:
        """One client connection of this process closed."""
        self.open -= 1
        self._asked = False
        SLOT.pack_into(self._map, self.slot * SLOT.size, self.open)

    def clear(self, slot: int) -> None:
        """Mark ``slot`` :data:`GONE`: its process is, and its connections
        and its share no longer count."""
        SLOT.pack_into(self._map, slot * SLOT.size, GONE)

    def ask_to_close(self) -> bool:
        """Whether the connection about to answer should close after its
        answer: this process holds more connections than its share of all
        (the total over the live processes, rounded up) and no connection
        it asked is still open."""
        if self._asked:
            return False
        live = [n for n in self._all.unpack_from(self._map) if n != GONE]
        self._asked = self.open > -(-sum(live) // len(live))
        return self._asked

    def argv(self, slot: int) -> list[str]:
        """The child's flag for ``slot`` (see :func:`from_flag`)."""
        return ["--connections", f"{self.fd}:{slot}:{self.slots}"]


def from_flag(text: str) -> Table:
    """The table a child's ``--connections FD:SLOT:SLOTS`` names.

    Raises:
        ValueError: not three integers.
    """
    fd, slot, slots = map(int, text.split(":"))
    return Table(fd, slot, slots)


#: This process's table: set by a ``serve --workers N`` child before it
#: serves; ``None`` in a process serving alone.
current: Table | None = None
