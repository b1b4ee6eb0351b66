"""KV cache events from one engine worker: the wire decoded, the sequence
checked, gaps replayed.

The wire (vLLM ``vllm/distributed/kv_events.py`` and SGLang
``sglang/srt/disaggregation/kv_events.py``, ``ZmqEventPublisher``): a PUB
socket sends multipart ``[topic, sequence number as 8 bytes big-endian,
msgpack EventBatch]``, the batch ``[timestamp, events, data-parallel
rank]``. Events are tagged msgpack maps (``{"type": "BlockStored", ...}``:
vLLM from 0.25, SGLang from 0.5.20, after vLLM's change away from arrays) or
positional arrays with the tag first (older releases:
``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium, ...]``); :func:`decode_batch` reads both. The replay
ROUTER socket answers ``[b"", start sequence as 8 bytes]`` with each
buffered batch from there on as ``[b"", topic, seq, payload]``, then
``[b"", b"", -1 as 8 bytes, b""]``.

:class:`Subscriber` runs one worker's SUB socket (pyzmq, non-blocking: it
waits on the socket's ``zmq.FD`` through the event loop, asyncio or trio
alike, and takes every queued message at each wake-up; the rare replay's
blocking calls run in a worker thread; every subscriber of the process
shares one ZMQ context, so a fleet of hundreds costs one I/O thread) and hands the batches, in sequence,
to its sink. On connecting it replays from 0 (what
the engine published before this frontend listened, as far as the buffer
reaches; the live copies of those are skipped). A sequence number that goes back is a restarted engine: the
sink resets. A gap is filled from the replay socket; when that cannot fill
it (no replay socket, the buffer moved on, no answer), the sink resets and
the index is rebuilt from what follows.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import anyio
import msgspec
import zmq

log = logging.getLogger("asgi_generate.kv_events")

#: The replay socket's end-of-replay sequence number.
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: Seconds a replay may take before the gap counts as unfillable.
REPLAY_TIMEOUT_S = 2.0

_decode = msgspec.msgpack.Decoder().decode


@dataclass(slots=True)
class Stored:
    """``BlockStored``: full blocks of ``block_size`` tokens (``token_ids``
    holds them all, in order) under ``parent`` (an engine block hash, or
    ``None`` at the root); ``salt`` the storing request's ``cache_salt``."""

    hashes: list
    parent: Any
    token_ids: list[int]
    block_size: int
    salt: str | None


@dataclass(slots=True)
class Removed:
    """``BlockRemoved``: the engine block hashes evicted."""

    hashes: list


class Cleared:
    """``AllBlocksCleared``: the engine's cache was emptied."""


Event = Stored | Removed | Cleared


def _salt_of(extra_keys: Any, lora_name: Any) -> str | None:
    """vLLM's salt: a string in the first block's ``extra_keys`` entry that
    is not the LoRA name (``BlockStored.extra_keys``)."""
    if isinstance(extra_keys, list) and extra_keys and isinstance(extra_keys[0], (list, tuple)):
        strings = [k for k in extra_keys[0] if isinstance(k, str) and k != lora_name]
        return strings[-1] if strings else None
    return None


def _event(raw: Any) -> Event | None:
    """One decoded event, either encoding; ``None`` for a type this
    frontend does not index."""
    if isinstance(raw, dict):
        kind = raw.get("type")
        if kind == "BlockStored":
            salt = raw.get("cache_salt") or _salt_of(raw.get("extra_keys"), raw.get("lora_name"))
            return Stored(raw["block_hashes"], raw.get("parent_block_hash"), raw["token_ids"], raw["block_size"], salt)
        if kind == "BlockRemoved":
            return Removed(raw["block_hashes"])
        return Cleared() if kind == "AllBlocksCleared" else None
    if isinstance(raw, list) and raw:
        kind = raw[0]
        if kind == "BlockStored":
            tail = raw[7:]
            salt = None
            if tail and isinstance(tail[0], dict):  # SGLang's metadata
                salt = tail[0].get("cache_salt")
            elif len(tail) >= 2:  # vLLM: lora_name, extra_keys
                salt = _salt_of(tail[1], tail[0])
            return Stored(raw[1], raw[2], raw[3], raw[4], salt)
        if kind == "BlockRemoved":
            return Removed(raw[1])
        return Cleared() if kind == "AllBlocksCleared" else None
    return None


def decode_batch(payload: bytes) -> list[Event]:
    """The events of one msgpack ``EventBatch``, in order.

    Raises:
        ValueError: not a batch (undecodable, or not ``[ts, events, ...]``),
            or an event missing a field its type requires.
    """
    try:
        batch = _decode(payload)
        if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
            raise ValueError("not an EventBatch [ts, events, rank]")
        return [e for e in map(_event, batch[1]) if e is not None]
    except (msgspec.DecodeError, KeyError, IndexError, TypeError) as exc:
        raise ValueError(f"undecodable KV event batch: {exc!r}") from None


class Sink(Protocol):
    """Where a subscriber's batches go (a worker's KV index)."""

    def apply(self, events: list[Event]) -> None:
        """Take one batch's events, in sequence."""

    def reset(self, reason: str) -> None:
        """Forget every block: ``reason`` is ``restart``, ``gap`` or ``bad``."""


@dataclass(slots=True)
class Source:
    """Where a worker publishes: its PUB endpoint, replay endpoint (or
    ``None``) and topic."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


class Subscriber:
    """Receives one worker's KV events and keeps them in sequence (see the
    module docstring).

    Attributes:
        batches, events: received and applied (replayed ones included).
        gaps: sequence gaps seen; replays: gaps (or the start) filled by
            replay; rebuilds: gaps replay could not fill; restarts: the
            sequence went back; bad: undecodable batches.
        last_seq: the last sequence number applied, ``None`` before any.

    ``on_batch`` is called after each batch is applied (the policy's load
    reader waits on it: :meth:`~asgi_generate.workers.policies.kv_worker.WorkerKV.wake`).
    """

    def __init__(self, source: Source, sink: Sink, on_batch: Callable[[], None] | None = None) -> None:
        self.source = source
        self.sink = sink
        self.on_batch = on_batch
        self.last_seq: int | None = None
        self.batches = self.events = self.gaps = self.replays = self.rebuilds = self.restarts = self.bad = 0

    def stats(self) -> dict[str, Any]:
        """The counters, for ``/stats``."""
        return {"endpoint": self.source.endpoint, "replay_endpoint": self.source.replay_endpoint,
                "batches": self.batches, "events": self.events, "gaps": self.gaps, "replays": self.replays,
                "rebuilds": self.rebuilds, "restarts": self.restarts, "bad_batches": self.bad,
                "last_seq": self.last_seq}

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """Subscribe and apply batches until cancelled."""
        # The process's one context: a context of its own would cost each
        # worker's subscriber two threads (ZMQ's I/O thread and reaper) and
        # their descriptors; one I/O thread serves hundreds of SUB sockets.
        ctx = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
            sub.connect(self.source.endpoint)
            task_status.started()
            # What was published before: live copies of it are skipped until
            # the sequence passes it (they are not a restart).
            history = await anyio.to_thread.run_sync(_replay, ctx, self.source.replay_endpoint, 0, None)
            if history:
                self.replays += 1
                for seq, payload in history:
                    self._apply(seq, payload)
            caught_up = self.last_seq
            # zmq.FD signals by edge: readable means "look at zmq.EVENTS",
            # so the queue is drained before each wait (and a message that
            # came while the FD was not watched is still taken).
            fd = sub.getsockopt(zmq.FD)
            while True:
                while sub.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    frames = sub.recv_multipart(zmq.NOBLOCK)
                    if len(frames) != 3:
                        continue
                    seq = int.from_bytes(frames[1], "big")
                    if caught_up is not None:
                        if seq <= caught_up:
                            continue
                        caught_up = None
                    await self._take(ctx, seq, frames[2])
                await anyio.wait_readable(fd)
        finally:
            sub.close(linger=0)

    async def _take(self, ctx: zmq.Context, seq: int, payload: bytes) -> None:
        last = self.last_seq
        if last is not None and seq <= last:
            self.restarts += 1
            self.sink.reset("restart")
            last = None
        start = 0 if last is None else last + 1
        if seq > start:
            if last is not None:
                self.gaps += 1
            missed = await anyio.to_thread.run_sync(_replay, ctx, self.source.replay_endpoint, start, seq)
            if missed is not None and (last is None or [s for s, _ in missed] == list(range(start, seq))):
                self.replays += 1
                for s, p in missed:
                    self._apply(s, p)
            elif last is not None:
                self.rebuilds += 1
                log.warning("KV events from %s: sequence %d to %d lost and not replayable; index rebuilt",
                            self.source.endpoint, start, seq - 1)
                self.sink.reset("gap")
        self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        self.last_seq = seq
        try:
            events = decode_batch(payload)
        except ValueError as exc:
            self.bad += 1
            log.warning("KV events from %s: %s; index rebuilt", self.source.endpoint, exc)
            self.sink.reset("bad")
            return
        self.batches += 1
        self.events += len(events)
        self.sink.apply(events)
        if self.on_batch is not None:
            self.on_batch()


def _replay(ctx: zmq.Context, endpoint: str | None, start: int, stop: int | None) -> list[tuple[int, bytes]] | None:
    """The batches ``start`` to ``stop - 1`` (``None``: all from ``start``)
    the replay socket at ``endpoint`` still holds, in order; ``None``
    without a replay socket or an answer within :data:`REPLAY_TIMEOUT_S`."""
    if endpoint is None:
        return None
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart((b"", start.to_bytes(8, "big")))
        got = []
        while True:
            if not sock.poll(int(REPLAY_TIMEOUT_S * 1000)):
                return None
            frames = sock.recv_multipart()
            if len(frames) != 4 or frames[2] == END_SEQ:
                return got
            seq = int.from_bytes(frames[2], "big")
            if start <= seq and (stop is None or seq < stop):
                got.append((seq, frames[3]))
    finally:
        sock.close(linger=0)
