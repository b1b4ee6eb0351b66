"""The simulator's SGLang prefill/decode disaggregation: a real KV hand-over
between a prefill and a decode simulator over loopback.

SGLang runs P/D as two servers: the prefill server (``--disaggregation-mode
prefill``) listens on a bootstrap port; the decode server (``--disaggregation-
mode decode``) is sent the same request carrying ``bootstrap_host``/
``bootstrap_port``/``bootstrap_room``, connects to that bootstrap server and
waits for the room's KV (``python/sglang/srt/disaggregation/decode.py``,
``prefill.py``, ``common/conn.py``). The simulator plays that exchange with a
line protocol on a TCP listener at the prefill's bootstrap port:

    decode -> prefill   {"room": N}\\n
    prefill -> decode   {"input_ids": [...], "first_token": T, "cached_tokens": C}\\n   (once prefilled)
    decode -> prefill   ok\\n                                       (transfer done)

The "KV" is the prompt and the first token, which the deterministic model
needs to continue exactly where an aggregated run would, and the prefill's
prefix-cache hit, which SGLang's metadata buffers carry to the decode so that
it reports the prefill's ``cached_tokens`` (``MetadataBuffers.set_buf`` in
``disaggregation/utils.py``, read by ``DecodeTransferQueue.
_commit_transfer_to_req`` in ``disaggregation/decode.py``). The prefill request
answers only after the hand-over, as SGLang's prefill finishes a request only
once its transfer succeeded. Either side gives up after its timeout (SGLang's
``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` on the prefill side,
``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` on the decode side, both 300 s by
default) with SGLang's messages.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import anyio
import anyio.abc
import orjson
from anyio.streams.buffered import BufferedByteReceiveStream

from .engine import Job

#: SGLang's default of both timeouts, in seconds.
DEFAULT_TIMEOUT_S = 300.0
#: The longest line either side accepts (a prompt of 32K token ids fits).
MAX_LINE = 1 << 20


def transfer_failed(rid: str, room: int, elapsed: float) -> str:
    """SGLang's decode-side abort message when the KV never came: the
    receiver's ``poll`` records ``Request {room} timed out after {elapsed}s in
    KVPoll.WaitingForInput`` (``mooncake/conn.py``), raised as
    ``KVTransferError`` (``__str__``: ``KVTransferError(bootstrap_room=N):
    reason``) and reported by ``DecodeTransferQueue.pop_transferred`` as
    ``Decode transfer failed for request rank=... {rid=} {bootstrap_room=}
    with exception ...``, an abort with status 500."""
    return (
        f"Decode transfer failed for request rank=0 decode_req.req.rid={rid!r} "
        f"decode_req.req.bootstrap_room={room} with exception KVTransferError(bootstrap_room={room}): "
        f"Request {room} timed out after {elapsed:.1f}s in KVPoll.WaitingForInput"
    )


def bootstrap_failed(rid: str, room: int, elapsed: float) -> str:
    """SGLang's prefill-side abort message when no decode server came for the
    room (``PrefillBootstrapQueue.pop_bootstrapped``: ``Prefill bootstrap
    failed for request rank=... {req.rid=} {req.bootstrap_room=} with
    exception ...``, status 500)."""
    return (
        f"Prefill bootstrap failed for request rank=0 req.rid={rid!r} req.bootstrap_room={room} "
        f"with exception KVTransferError(bootstrap_room={room}): "
        f"Request {room} timed out after {elapsed:.1f}s in KVPoll.Bootstrapping"
    )


@dataclass(slots=True)
class Room:
    """One bootstrap room on the prefill side.

    ``claimed``: a prefill request owns it (a decode may come first);
    ``kv``: the line to hand over, set once prefilled; ``pulled``: the
    decode confirmed the transfer.
    """

    claimed: bool = False
    kv: bytes | None = None
    ready: anyio.Event = field(default_factory=anyio.Event)
    pulled: anyio.Event = field(default_factory=anyio.Event)


class PrefillRooms:
    """The prefill side: the rooms of running requests and their bootstrap
    listener.

    Args:
        port: the bootstrap port to listen on (loopback; 0: any free port).
        timeout_s: how long a room waits for its decode server.
    """

    def __init__(self, port: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.port = port
        self.timeout_s = timeout_s
        self.rooms: dict[int, Room] = {}
        self.transfers = 0
        self.timeouts = 0

    @property
    def waiting(self) -> int:
        """Rooms a prefill request holds whose KV no decode took yet."""
        return sum(r.claimed and not r.pulled.is_set() for r in self.rooms.values())

    async def serve(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """Listen on the bootstrap port until cancelled."""
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=self.port)
        # Port 0 takes a free one; server info reports the one taken.
        self.port = listener.extra(anyio.abc.SocketAttribute.local_port)
        task_status.started()
        async with listener:
            await listener.serve(self._connection)

    def claim(self, room: int) -> Room:
        """The room for a new prefill request.

        Raises:
            ValueError: a running request already holds ``room``.
        """
        r = self.rooms.setdefault(room, Room())
        if r.claimed:
            raise ValueError(f"bootstrap_room {room} is already in use.")
        r.claimed = True
        return r

    def release(self, room: int, r: Room) -> None:
        """The prefill request holding ``r`` ended."""
        if self.rooms.get(room) is r:
            del self.rooms[room]

    async def hand_over(self, job: Job, r: Room, input_ids: list[int], first_token: int) -> float | None:
        """Offer the KV of ``job`` (with its ``cached_tokens``) and wait
        until a decode took it; ``None`` when it did, else the seconds
        waited (timed out). Returns early, with ``job.aborted`` set, when
        the job is aborted."""
        kv = {"input_ids": input_ids, "first_token": first_token, "cached_tokens": job.cached_tokens}
        r.kv = orjson.dumps(kv) + b"\n"
        r.ready.set()
        t0 = time.monotonic()
        with anyio.move_on_after(self.timeout_s):
            async with anyio.create_task_group() as tg:

                async def pulled() -> None:
                    await r.pulled.wait()
                    tg.cancel_scope.cancel()

                tg.start_soon(pulled)
                await job.abort_event.wait()
                tg.cancel_scope.cancel()
        if r.pulled.is_set() or job.aborted:
            return None
        self.timeouts += 1
        return time.monotonic() - t0

    async def _connection(self, stream: anyio.abc.ByteStream) -> None:
        room_id: int | None = None
        created = False
        try:
            async with stream:
                reader = BufferedByteReceiveStream(stream)
                with anyio.fail_after(self.timeout_s):
                    ask = orjson.loads(await reader.receive_until(b"\n", MAX_LINE))
                    room_id = ask["room"]
                    r = self.rooms.get(room_id)
                    if r is None:
                        r = self.rooms[room_id] = Room()
                        created = True
                    await r.ready.wait()
                    await stream.send(r.kv)
                    if await reader.receive_until(b"\n", 16) == b"ok":
                        self.transfers += 1
                        r.pulled.set()
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.DelimiterNotFound, anyio.BrokenResourceError,
                TimeoutError, orjson.JSONDecodeError, KeyError, TypeError):
            pass  # the decode went away or timed out: the prefill side times out on its own
        finally:
            if created and room_id is not None:
                r = self.rooms.get(room_id)
                if r is not None and not r.claimed:
                    del self.rooms[room_id]


class DecodeKV:
    """The decode side: fetches a room's KV from the prefill named in the
    request.

    Args:
        timeout_s: how long a request waits for its KV.
    """

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self.waiting = 0
        self.transfers = 0
        self.timeouts = 0

    async def fetch(self, job: Job, host: str, port: int, room: int) -> tuple[list[int], int, int] | float | None:
        """Wait for ``room``'s KV: ``(input_ids, first_token, the prefill's
        cached_tokens)``; the seconds
        waited when it never came in time; ``None`` when the job was aborted
        meanwhile. A prefill that cannot be reached yet is tried again until
        the timeout (SGLang keeps polling its bootstrap server too)."""
        t0 = time.monotonic()
        got: list = []
        self.waiting += 1
        try:
            with anyio.move_on_after(self.timeout_s):
                async with anyio.create_task_group() as tg:

                    async def aborted() -> None:
                        await job.abort_event.wait()
                        tg.cancel_scope.cancel()

                    tg.start_soon(aborted)
                    got.append(await self._pull(host.strip("[]"), port, room))
                    tg.cancel_scope.cancel()
        finally:
            self.waiting -= 1
        if job.aborted:
            return None
        if not got:
            self.timeouts += 1
            return time.monotonic() - t0
        self.transfers += 1
        return got[0]

    @staticmethod
    async def _pull(host: str, port: int, room: int) -> tuple[list[int], int, int]:
        while True:
            try:
                stream = await anyio.connect_tcp(host, port)
            except OSError:
                await anyio.sleep(0.05)
                continue
            async with stream:
                reader = BufferedByteReceiveStream(stream)
                try:
                    await stream.send(orjson.dumps({"room": room}) + b"\n")
                    kv = orjson.loads(await reader.receive_until(b"\n", MAX_LINE))
                    await stream.send(b"ok\n")
                    return kv["input_ids"], kv["first_token"], kv["cached_tokens"]
                except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError):
                    pass  # the prefill's listener timed out on this room: ask again
            await anyio.sleep(0.05)
