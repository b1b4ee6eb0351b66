"""KV cache events, published by the simulator as the engines publish them.

The configuration is ``sim --kv-events-config JSON``, each engine's keys:
vLLM's ``KVEventsConfig`` (``vllm/config/kv_events.py``:
``enable_kv_cache_events``, ``publisher``, ``endpoint`` default
``tcp://*:5557``, ``replay_endpoint``, ``buffer_steps``, ``hwm``,
``max_queue_size``, ``topic``) and SGLang's (``KVEventsConfig`` in
``sglang/srt/disaggregation/kv_events.py``: ``publisher``, ``endpoint``,
``bind``, ``replay_endpoint``, ``buffer_steps``, ``hwm``,
``max_queue_size``, ``topic``, ``format``). A port of 0 binds a free one on
loopback and advertises it (vLLM's ``tcp://*:0`` does the same on the node's
address).

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
trailing ``{"cache_salt": ...}``). vLLM publishes hashes as unsigned 64-bit
ints, SGLang as signed.

Discovery: vLLM ``GET /kv_event_sources`` (0.32 and later,
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

from ..sdk.versions import parse_version

#: The replay socket's end-of-replay sequence number.
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_U64 = (1 << 64) - 1

_VLLM_KEYS = frozenset({"enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "buffer_steps", "hwm",
                        "max_queue_size", "topic"})
_SGLANG_KEYS = frozenset({"publisher", "endpoint", "bind", "replay_endpoint", "buffer_steps", "hwm",
                          "max_queue_size", "topic", "format"})
#: The first SGLang release whose events are tagged maps.
SGLANG_MAP_EVENTS = (0, 5, 20)


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """Where and how the simulator publishes (the parsed ``--kv-events-config``)."""

    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @classmethod
    def parse(cls, protocol: str, text: str) -> "KVEventsConfig | None":
        """The config ``text`` gives for ``protocol``; ``None`` when it turns
        publishing off (vLLM without ``enable_kv_cache_events``, or either
        engine's ``publisher`` ``"null"``).

        Raises:
            ValueError: not a JSON object, a key the engine does not take, a
                value of the wrong type, or a publisher other than zmq/null.
        """
        try:
            obj = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config is not JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = _VLLM_KEYS if protocol == "vllm" else _SGLANG_KEYS
        unknown = sorted(set(obj) - known)
        if unknown:
            raise ValueError(f"--kv-events-config: {protocol} takes no {', '.join(unknown)}")
        if protocol == "vllm":
            enabled = obj.get("enable_kv_cache_events", False)
            publisher = obj.get("publisher") or ("zmq" if enabled else "null")
        else:
            enabled, publisher = True, obj.get("publisher", "null")
        if publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config: unknown publisher {publisher!r}")
        fields = {k: v for k, v in obj.items() if k in cls.__slots__}
        for key, kind in (("endpoint", str), ("topic", str), ("buffer_steps", int), ("hwm", int),
                          ("max_queue_size", int)):
            if key in fields and type(fields[key]) is not kind:
                raise ValueError(f"--kv-events-config: {key} must be a {kind.__name__}")
        if fields.get("replay_endpoint") is not None and type(fields["replay_endpoint"]) is not str:
            raise ValueError("--kv-events-config: replay_endpoint must be a string")
        if not enabled or publisher == "null":
            return None
        return cls(**fields)


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

    def _hash(self, h: int) -> int:
        return h & _U64 if self.vllm else h

    def stored(self, hashes: list[int], parent: int | None, token_ids: list[int],
               namespace: tuple[str | None, ...]) -> object:
        """A ``BlockStored`` of the blocks ``hashes`` (their ``token_ids``)
        under ``parent``, stored by a request of ``namespace`` (the job's)."""
        hashes = [self._hash(h) for h in hashes]
        parent = None if parent is None else self._hash(parent)
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
        hashes = [self._hash(h) for h in hashes]
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


def _bind(sock: zmq.Socket, endpoint: str) -> str:
    """Bind ``endpoint`` (port 0: a free port on loopback); the endpoint a
    subscriber on this host dials."""
    host, _, port = endpoint.rpartition(":")
    if port == "0":
        sock.bind(f"{host}:*" if host != "tcp://*" else "tcp://127.0.0.1:*")
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)
    sock.bind(endpoint)
    return endpoint


class KVEventPublisher:
    """The PUB and replay ROUTER sockets of one simulated engine.

    :meth:`publish` runs on the server's event loop (the PUB socket is only
    ever touched there); the replay socket is served by a thread of its own,
    as the engines' publisher thread does, over a buffer shared under a lock.

    Args:
        config: the parsed configuration.
        wire: the encoding.

    Attributes:
        endpoint: the PUB endpoint as bound (a port 0 resolved).
        replay_endpoint: the ROUTER endpoint as bound, or ``None``.
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
        self.endpoint = _bind(self._pub, config.endpoint)
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
            self.replay_endpoint = _bind(self._router, config.replay_endpoint)
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

    def sglang_descriptor(self) -> dict:
        """SGLang ``/server_info``'s ``kv_events`` block."""
        host, _, port = self.endpoint[len("tcp://"):].rpartition(":")
        out = {"publisher": "zmq", "endpoint_host": host, "endpoint_port_base": int(port),
               "topic": self.config.topic, "block_size": self.wire.block_size, "dp_size": 1}
        if self.replay_endpoint is not None:
            out["replay_endpoint_port_base"] = int(self.replay_endpoint.rpartition(":")[2])
        return out

    def stats(self) -> dict:
        """The ``/sim/stats`` ``kv_events`` counters."""
        return {"endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint, "next_seq": self._seq,
                "batches": self.published, "events": self.events, "dropped": self.dropped,
                "replays": self.replays}
