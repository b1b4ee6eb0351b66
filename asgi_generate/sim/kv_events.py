"""KV cache events, published by the simulator as the engines publish them.

The configuration is ``sim --kv-events-config JSON``, each engine's keys:
vLLM's ``KVEventsConfig`` (``vllm/config/kv_events.py``:
``enable_kv_cache_events``, ``publisher``, ``endpoint`` default
``tcp://*:5557``, ``replay_endpoint``, ``buffer_steps``, ``hwm``,
``max_queue_size``, ``topic``) and SGLang's (``KVEventsConfig`` in
``sglang/srt/disaggregation/kv_events.py``: ``publisher``, ``endpoint``,
``bind``, ``replay_endpoint``, ``buffer_steps``, ``hwm``,
``max_queue_size``, ``topic``, ``format``), read as :meth:`KVEventsConfig.parse`
says.

Bind or connect (:func:`publisher_binds`): the PUB socket binds a wildcard
endpoint (``*``, ``::``; SGLang also ``0.0.0.0``) or an ``ipc://`` or
``inproc://`` one and CONNECTS to any other, a concrete host such as
``tcp://127.0.0.1:5557``, where a subscriber (or a proxy's XSUB socket) has
to bind; SGLang's ``bind`` key overrides that either way. The replay ROUTER
socket always binds. ``tcp://*:0`` binds a free loopback port and reports
it (vLLM binds a free port of the node's address, ``VLLM_HOST_IP``); vLLM
reports any other endpoint as given. SGLang with a bound port of 0 is the
one place the simulator is looser than the engine: it advertises the port
it got in ``/server_info``, where SGLang advertises no publisher (port 0
is not one it describes), so tests can take free ports.

The wire (``ZmqEventPublisher._publisher_thread`` and ``_service_replay`` in
both engines' ``kv_events.py``): a PUB socket sends multipart ``[topic,
sequence number as 8 bytes big-endian, msgpack EventBatch]``, the batch the
array ``[timestamp, events, data-parallel rank]``. A ROUTER replay socket
answers ``[identity, b"", start sequence as 8 bytes]`` with every buffered
batch from that number on, each ``[identity, b"", topic, seq, payload]``,
then ``[identity, b"", b"", -1 as 8 bytes signed, b""]``.

The events (:class:`EventWire`): ``BlockStored`` (one per run of blocks
stored under one parent, as SGLang's ``KVCacheEventRecorder.enqueue``
coalesces and vLLM's ``BlockPool.cache_full_blocks`` emits),
``BlockRemoved`` (the blocks evicted together), ``AllBlocksCleared`` (a
flush). Tagged msgpack maps (``{"type": "BlockStored", ...}``, None-valued
optional fields left out) for vLLM 0.25 and later and SGLang 0.5.20 and
later; SGLang before 0.5.20 sends positional arrays (``["BlockStored",
hashes, parent, token ids, block size, lora id, medium]``, the salt as a
trailing ``{"cache_salt": ...}``). The hashes are each engine's own
(:mod:`asgi_generate.sim.block_hash`): vLLM publishes unsigned 64-bit ints,
SGLang signed.

Discovery: vLLM ``GET /kv_event_sources`` (0.31 and later,
``vllm/entrypoints/serve/instrumentator/basic.py``: the publisher's config
per data-parallel rank); SGLang ``/server_info``'s ``kv_events``
(``describe_kv_events_publisher`` in ``sglang/srt/runtime_context.py``).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

import msgspec
import orjson
import zmq

from .lax import LaxError, lax_scalar
from .versions import parse_version

#: The replay socket's end-of-replay sequence number.
END_SEQ = (-1).to_bytes(8, "big", signed=True)

_VLLM_KEYS = frozenset({"enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "buffer_steps", "hwm",
                        "max_queue_size", "topic"})
_SGLANG_KEYS = frozenset({"publisher", "endpoint", "bind", "replay_endpoint", "buffer_steps", "hwm",
                          "max_queue_size", "topic", "format"})
#: Both engines' default PUB endpoint.
DEFAULT_ENDPOINT = "tcp://*:5557"
#: The first SGLang release whose events are tagged maps.
SGLANG_MAP_EVENTS = (0, 5, 20)


def _lax(key: str, value: object, kind: type) -> object:
    """``value`` as pydantic's lax mode takes it for a field of ``kind``
    (``int``, ``bool`` or ``str``; both engines parse the config with
    pydantic: vLLM's ``@config`` dataclass, SGLang's ``BaseModel``), by
    :func:`~asgi_generate.sim.lax.lax_scalar`.

    Raises:
        ValueError: a value pydantic refuses, naming ``key``.
    """
    try:
        return lax_scalar(kind.__name__, value)
    except LaxError:
        article = "an" if kind is int else "a"
        raise ValueError(f"--kv-events-config: {key} must be {article} {kind.__name__}, got {value!r}") from None


def publisher_binds(protocol: str, endpoint: str, bind: bool | None = None) -> bool:
    """Whether the engine BINDS its PUB socket at ``endpoint`` (else it
    CONNECTS there, and a subscriber, or a proxy, must bind).

    vLLM (``ZmqEventPublisher._is_bind_endpoint``,
    ``vllm/distributed/kv_events.py``): an endpoint with ``*`` or ``::``
    in it, or an ``ipc://``/``inproc://`` one, binds. SGLang
    (``ZmqEventPublisher._socket_setup``,
    ``sglang/srt/disaggregation/kv_events.py``): its ``bind`` key decides
    when set; unset, the same rule with ``0.0.0.0`` binding too. The
    replay ROUTER socket always binds, in both.
    """
    if protocol == "sglang" and bind is not None:
        return bind
    wildcards = ("*", "::", "0.0.0.0") if protocol == "sglang" else ("*", "::")
    return any(w in endpoint for w in wildcards) or endpoint.startswith(("ipc://", "inproc://"))


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """Where and how the simulator publishes (the parsed ``--kv-events-config``).

    ``bind`` is whether the PUB socket binds ``endpoint`` or connects to it
    (:func:`publisher_binds`, resolved by :meth:`parse`); ``max_queue_size``
    bounds the engines' queue between the scheduler and the publisher
    thread, which the simulator has not (it publishes on its own loop), so
    it is only reported back.
    """

    endpoint: str = DEFAULT_ENDPOINT
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    bind: bool = True

    @classmethod
    def parse(cls, protocol: str, text: str) -> "KVEventsConfig | None":
        """The config ``text`` gives for ``protocol``; ``None`` when it turns
        publishing off (vLLM without ``enable_kv_cache_events``, or either
        engine's ``publisher`` ``"null"``).

        As each engine reads it: vLLM's ``KVEventsConfig``
        (``vllm/config/kv_events.py``, a pydantic dataclass that forbids
        other keys; ``publisher`` one of ``"null"``/``"zmq"``) and SGLang's
        (``KVEventsConfig.from_cli`` in
        ``sglang/srt/disaggregation/kv_events.py``, a pydantic model that
        ignores other keys; ``EventPublisherFactory.create`` refuses a
        publisher it does not know, ``Unknown event publisher 'NAME'``).
        Values are taken as pydantic's lax mode takes them (:func:`_lax`).
        A negative ``buffer_steps`` is refused as the engines' replay
        buffer refuses it (``deque(maxlen=...)``: ``maxlen must be
        non-negative``), a negative ``hwm`` as ZMQ does (``Invalid
        argument``).

        Raises:
            ValueError: not a JSON object, a key vLLM does not take, a
                value of the wrong type, a publisher the engine does not
                know, a negative ``buffer_steps`` or ``hwm``, or SGLang's
                ``format`` ``"dynamo"`` (which the simulator does not play).
        """
        try:
            obj = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config is not JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        if protocol == "vllm":
            unknown = sorted(set(obj) - _VLLM_KEYS)
            if unknown:
                raise ValueError(f"--kv-events-config: vllm takes no {', '.join(unknown)}")
            enabled = _lax("enable_kv_cache_events", obj.get("enable_kv_cache_events", False), bool)
            fmt = "default"
            publisher = obj["publisher"] if "publisher" in obj else "zmq" if enabled else "null"
            if publisher not in ("zmq", "null"):
                raise ValueError(f"--kv-events-config: publisher must be 'null' or 'zmq', got {publisher!r}")
        else:
            obj = {k: v for k, v in obj.items() if k in _SGLANG_KEYS}
            enabled, publisher = True, _lax("publisher", obj.get("publisher", "null"), str)
            fmt = _lax("format", obj.get("format", "default"), str)
            if fmt not in ("default", "dynamo"):
                raise ValueError(f"--kv-events-config: format must be 'default' or 'dynamo', got {fmt!r}")
            if publisher not in ("zmq", "null"):
                raise ValueError(f"--kv-events-config: Unknown event publisher '{publisher}'")
        fields = {}
        for key, kind in (("endpoint", str), ("topic", str), ("buffer_steps", int), ("hwm", int),
                          ("max_queue_size", int)):
            if key in obj:
                fields[key] = _lax(key, obj[key], kind)
        if obj.get("replay_endpoint") is not None:
            fields["replay_endpoint"] = _lax("replay_endpoint", obj["replay_endpoint"], str)
        bind = obj.get("bind")
        if bind is not None:
            bind = _lax("bind", bind, bool)
        if not enabled or publisher == "null":
            return None
        if fmt == "dynamo":
            raise ValueError("--kv-events-config: the simulator does not play format 'dynamo'")
        if fields.get("buffer_steps", 0) < 0:
            raise ValueError(f"--kv-events-config: buffer_steps {fields['buffer_steps']}: maxlen must be non-negative")
        if fields.get("hwm", 0) < 0:
            raise ValueError(f"--kv-events-config: hwm {fields['hwm']}: Invalid argument")
        return cls(**fields, bind=publisher_binds(protocol, fields.get("endpoint", DEFAULT_ENDPOINT), bind))


class EventWire:
    """Builds events and batches as one engine version encodes them.

    Args:
        protocol: ``"sglang"`` or ``"vllm"``.
        version: the engine version played (``None``: the newest).
        block_size: tokens per block (vLLM ``--block-size``, SGLang
            ``--page-size``).
    """

    def __init__(self, protocol: str, version: str | None, block_size: int) -> None:
        self.vllm = protocol == "vllm"
        played = parse_version(version) if version else None
        self.maps = self.vllm or played is None or played >= SGLANG_MAP_EVENTS
        self.block_size = block_size
        self._encode = msgspec.msgpack.Encoder().encode

    def stored(self, hashes: list[int], parent: int | None, token_ids: list[int],
               namespace: tuple[str | None, ...]) -> object:
        """A ``BlockStored`` of the blocks ``hashes`` (their ``token_ids``)
        under ``parent`` (published ints, :mod:`asgi_generate.sim.block_hash`),
        stored by a request of ``namespace`` (the job's)."""
        salt = namespace[-1] if namespace else None
        if self.vllm:  # vllm/v1/core/block_pool.py BlockPool.cache_full_blocks
            extra = [(salt,) if salt is not None and parent is None and i == 0 else None for i in range(len(hashes))]
            return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                    "token_ids": token_ids, "block_size": self.block_size, "lora_id": None, "medium": "GPU",
                    "lora_name": None, "extra_keys": extra, "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
        if not self.maps:
            event = ["BlockStored", hashes, parent, token_ids, self.block_size, None, "GPU"]
            return event if salt is None else [*event, {"cache_salt": salt}]
        event = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": token_ids,
                 "block_size": self.block_size, "lora_id": None, "medium": "GPU"}
        if salt is not None:
            event["cache_salt"] = salt
        return event

    def removed(self, hashes: list[int]) -> object:
        """A ``BlockRemoved`` of ``hashes``."""
        if self.vllm:
            return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", "group_idx": 0}
        if not self.maps:
            return ["BlockRemoved", hashes, "GPU"]
        return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}

    def cleared(self) -> object:
        """An ``AllBlocksCleared``."""
        return {"type": "AllBlocksCleared"} if self.maps else ["AllBlocksCleared"]

    def batch(self, events: list[object], ts: float) -> bytes:
        """The msgpack ``EventBatch`` ``[ts, events, 0]`` (data-parallel rank 0)."""
        return self._encode([ts, events, 0])


def _bind(sock: zmq.Socket, endpoint: str, vllm: bool) -> str:
    """Bind ``endpoint``; the endpoint the engine reports.

    vLLM (``ZmqEventPublisher._bind``) resolves only ``tcp://*:0``, to a
    free port of the node's address (the simulator's: a free loopback
    port), and reports any other endpoint as given, a port of 0 included.
    SGLang binds as given; the simulator reports a port of 0 resolved (its
    ``/server_info`` would advertise no publisher on port 0).

    Raises:
        ValueError: ZMQ refused the bind (its message, as the engine fails
            at start).
    """
    try:
        if endpoint == "tcp://*:0":
            sock.bind("tcp://127.0.0.1:0")
            return sock.getsockopt_string(zmq.LAST_ENDPOINT)
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise ValueError(f"--kv-events-config: cannot bind {endpoint}: {exc}") from None
    if not vllm and endpoint.startswith("tcp://") and endpoint.rpartition(":")[2] == "0":
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return endpoint


def _connect(sock: zmq.Socket, endpoint: str) -> str:
    """Connect ``sock`` to ``endpoint`` (as both engines' publisher does to
    an endpoint it does not bind; ZMQ retries until a peer binds there).

    Raises:
        ValueError: ZMQ refused the endpoint (a wildcard host SGLang was
            told not to bind, say).
    """
    try:
        sock.connect(endpoint)
    except zmq.ZMQError as exc:
        raise ValueError(f"--kv-events-config: cannot connect to {endpoint}: {exc}") from None
    return endpoint


def _advertisable(endpoint: str | None) -> tuple[str, int] | None:
    """``(host, port)`` of a ``tcp://HOST:PORT`` endpoint with a port from 1
    to 65535, else ``None`` (SGLang's ``parse_advertisable_tcp``)."""
    if not endpoint or not endpoint.startswith("tcp://"):
        return None
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) <= 65535:
        return None
    return host, int(port)


class KVEventPublisher:
    """The PUB and replay ROUTER sockets of one simulated engine.

    :meth:`publish` runs on the server's event loop (the PUB socket is only
    ever touched there); the replay socket is served by a thread of its own,
    as the engines' publisher thread does, over a buffer shared under a lock.

    Args:
        config: the parsed configuration.
        wire: the encoding.

    Attributes:
        endpoint: the PUB endpoint as the engine reports it (bound, a port
            0 resolved as :func:`_bind` says, or connected to).
        replay_endpoint: the ROUTER endpoint as bound (see :func:`_bind`),
            or ``None``.
        published: batches sent (or dropped by the fault hook).
        events: events in them.
        replays: replay requests served.
        dropped: sequence numbers the fault hook kept off the wire.
    """

    def __init__(self, config: KVEventsConfig, wire: EventWire) -> None:
        self.config = config
        self.wire = wire
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        vllm = wire.vllm
        try:
            self.endpoint = (_bind(self._pub, config.endpoint, vllm) if config.bind
                             else _connect(self._pub, config.endpoint))
        except ValueError:
            self._ctx.destroy(linger=0)
            raise
        self._topic = config.topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._lock = threading.Lock()
        self._seq = 0
        self._drop: range = range(0)
        self.published = self.events = self.replays = self.dropped = 0
        self.replay_endpoint: str | None = None
        self._router: zmq.Socket | None = None
        self._running = True
        self._thread: threading.Thread | None = None
        if config.replay_endpoint is not None:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.setsockopt(zmq.SNDHWM, 2 * (config.buffer_steps + 1))
            try:
                self.replay_endpoint = _bind(self._router, config.replay_endpoint, vllm)
            except ValueError:
                self._ctx.destroy(linger=0)
                raise
            self._thread = threading.Thread(target=self._serve_replay, name="kv-replay", daemon=True)
            self._thread.start()

    def publish(self, events: list[object]) -> None:
        """Send one batch of ``events`` under the next sequence number (and
        buffer it for replay); a number in the fault hook's range is buffered
        but never sent live."""
        if not events:
            return
        seq = self._seq
        self._seq += 1
        payload = self.wire.batch(events, time.time())
        with self._lock:
            self._buffer.append((seq, payload))
        self.published += 1
        self.events += len(events)
        if seq in self._drop:
            self.dropped += 1
            return
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.Again:  # past the high-water mark, as a PUB socket drops
            pass

    def drop(self, start: int, stop: int) -> None:
        """Keep sequence numbers ``start`` to ``stop - 1`` off the live wire
        (``POST /sim/kv_events``): a subscriber sees a gap that replay fills
        while the buffer still holds them."""
        self._drop = range(start, stop)

    def restart(self) -> None:
        """Start the sequence over with an empty buffer, as a restarted engine."""
        with self._lock:
            self._buffer.clear()
        self._seq = 0

    def _serve_replay(self) -> None:
        router = self._router
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        while self._running:
            if not poller.poll(100):
                continue
            frames = router.recv_multipart()
            if len(frames) != 3:
                continue
            ident, _, start = frames
            first = int.from_bytes(start, "big")
            with self._lock:
                batches = [(seq, payload) for seq, payload in self._buffer if seq >= first]
            # Counted before the answer goes out: a client that has read the
            # end marker finds its replay in the stats.
            self.replays += 1
            for seq, payload in batches:
                router.send_multipart((ident, b"", self._topic, seq.to_bytes(8, "big"), payload))
            router.send_multipart((ident, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        """Stop the replay thread and close the sockets."""
        self._running = False
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        self._ctx.destroy(linger=0)

    def vllm_sources(self) -> dict:
        """vLLM's ``GET /kv_event_sources`` body: the config per rank."""
        c = self.config
        return {"0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": self.endpoint,
                      "replay_endpoint": self.replay_endpoint, "buffer_steps": c.buffer_steps, "hwm": c.hwm,
                      "max_queue_size": c.max_queue_size, "topic": c.topic}}

    def sglang_descriptor(self) -> dict | None:
        """SGLang ``/server_info``'s ``kv_events`` block
        (``describe_kv_events_publisher``, ``sglang/srt/runtime_context.py``):
        the endpoint's host and port as configured, bound or connected to
        alike, ``None`` when it is not ``tcp://`` with a port from 1 to
        65535 (``parse_advertisable_tcp``); the replay port only on the
        same terms."""
        pub = _advertisable(self.endpoint)
        if pub is None:
            return None
        out = {"publisher": "zmq", "endpoint_host": pub[0], "endpoint_port_base": pub[1],
               "topic": self.config.topic, "block_size": self.wire.block_size, "dp_size": 1}
        replay = _advertisable(self.replay_endpoint)
        if replay is not None:
            out["replay_endpoint_port_base"] = replay[1]
        return out

    def stats(self) -> dict:
        """The ``/sim/stats`` ``kv_events`` counters."""
        return {"endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint, "next_seq": self._seq,
                "batches": self.published, "events": self.events, "dropped": self.dropped,
                "replays": self.replays}
