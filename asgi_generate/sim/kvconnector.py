"""The simulator's vLLM KV connector: a prefill producer and a decode
consumer handing KV blocks over loopback.

vLLM runs P/D with a KV connector (``vllm/distributed/kv_transfer/
kv_connector/v1/nixl/``, ``NixlConnector``): a request whose
``kv_transfer_params`` say ``do_remote_decode`` is prefilled by the producer
(``kv_role`` ``kv_producer``), which, when it finished as its connector
allows, keeps the request's KV blocks and answers ``kv_transfer_params``
naming them (``request_finished``: ``do_remote_prefill``,
``remote_block_ids``, ``remote_engine_id``, ``remote_request_id``,
``remote_host``, ``remote_port``, ``tp_size``); otherwise it frees them and
answers none. Which finishes hand off is the connector's (``kv_connector``):
``NixlConnector`` a length cap or a stop (``nixl/pull_scheduler.py``
``request_finished``, 0.27 to 0.33), ``MoRIIOConnector`` a length cap only
(``moriio/moriio_connector.py`` ``request_finished``), so a prefill whose
one token is EOS or a stop token hands nothing off there. From vLLM 0.31 the
parameters also carry ``remote_prefill_cached_tokens``, the producer's
prefix-cache hit. The consumer, given those parameters, reads the blocks
from the producer's side channel and decodes from there; the producer frees
blocks a consumer read, or that no consumer read within
``VLLM_NIXL_ABORT_REQUEST_TIMEOUT`` (the simulator's ``--kv-expiry-s``).
Blocks that are gone make the consumer prefill locally (vLLM's
``kv_load_failure_policy`` recompute), which the simulator counts; so does a
consumer that declines the blocks (it still reads them, which frees them, as
vLLM's consumer notifies the producer of a request it loads nothing for,
``update_state_after_alloc``).

The side channel is a line protocol on a loopback TCP listener:

    consumer -> producer   {"remote_request_id": ..., "remote_block_ids": [...]}\\n
    producer -> consumer   {"input_ids": [...]}\\n   or   {"gone": true}\\n
"""

from __future__ import annotations

import itertools
import time
import uuid
from dataclasses import dataclass

import anyio
import anyio.abc
import orjson
from anyio.streams.buffered import BufferedByteReceiveStream

#: vLLM's ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT`` default, in seconds.
DEFAULT_EXPIRY_S = 480.0
BLOCK_SIZE = 16
MAX_LINE = 1 << 20


@dataclass(slots=True)
class Held:
    """KV blocks a producer keeps for a consumer."""

    input_ids: list[int]
    block_ids: list[int]
    expires: float


#: The connectors the producer plays, by the finish reasons that hand off.
HANDOFF_FINISHES = {"nixl": ("length", "stop"), "moriio": ("length",)}


class KVProducer:
    """The prefill side: holds finished prefills' blocks and serves them.

    Args:
        expiry_s: how long unread blocks are kept.
        connector: ``nixl`` or ``moriio`` (:data:`HANDOFF_FINISHES`).

    Raises:
        ValueError: an unknown connector.
    """

    def __init__(self, expiry_s: float = DEFAULT_EXPIRY_S, connector: str = "nixl") -> None:
        if connector not in HANDOFF_FINISHES:
            raise ValueError(f"unknown KV connector {connector!r}")
        self.handoff = HANDOFF_FINISHES[connector]
        self.expiry_s = expiry_s
        self.engine_id = uuid.uuid4().hex
        self.port = 0
        self.held: dict[str, Held] = {}
        self.expired = 0
        self.transfers = 0
        self._block_ids = itertools.count()

    @property
    def blocks_held(self) -> int:
        """KV blocks kept for consumers now (after dropping expired ones)."""
        self._expire()
        return sum(len(h.block_ids) for h in self.held.values())

    async def serve(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """Run the side channel on a free loopback port, and expire blocks,
        until cancelled."""
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        self.port = listener.extra(anyio.abc.SocketAttribute.local_port)
        task_status.started()
        async with listener, anyio.create_task_group() as tg:
            tg.start_soon(self._expire_loop)
            await listener.serve(self._connection)

    def finished(self, request_id: str, input_ids: list[int], finish: str, cached_tokens: int | None) -> dict | None:
        """A ``do_remote_decode`` request finished with ``finish``: its
        ``kv_transfer_params`` for the answer (``None`` unless the connector
        hands that finish off), with ``remote_prefill_cached_tokens`` unless
        ``cached_tokens`` is ``None`` (a vLLM before 0.31)."""
        if finish not in self.handoff:
            return None
        blocks = [next(self._block_ids) for _ in range(-(-len(input_ids) // BLOCK_SIZE))]
        self.held[request_id] = Held(input_ids, blocks, time.monotonic() + self.expiry_s)
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": blocks,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request_id,
            "remote_host": "127.0.0.1",
            "remote_port": self.port,
            "tp_size": 1,
        }
        if cached_tokens is not None:
            params["remote_prefill_cached_tokens"] = cached_tokens
        return params

    def _expire(self) -> None:
        now = time.monotonic()
        for rid in [r for r, h in self.held.items() if h.expires <= now]:
            del self.held[rid]
            self.expired += 1

    async def _expire_loop(self) -> None:
        while True:
            await anyio.sleep(min(1.0, self.expiry_s))
            self._expire()

    async def _connection(self, stream: anyio.abc.ByteStream) -> None:
        try:
            async with stream:
                reader = BufferedByteReceiveStream(stream)
                with anyio.fail_after(30):
                    ask = orjson.loads(await reader.receive_until(b"\n", MAX_LINE))
                    self._expire()
                    held = self.held.get(ask["remote_request_id"])
                    if held is None or held.block_ids != ask["remote_block_ids"]:
                        await stream.send(b'{"gone":true}\n')
                        return
                    del self.held[ask["remote_request_id"]]  # read: freed
                    self.transfers += 1
                    await stream.send(orjson.dumps({"input_ids": held.input_ids}) + b"\n")
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.DelimiterNotFound, anyio.BrokenResourceError,
                TimeoutError, orjson.JSONDecodeError, KeyError, TypeError):
            pass


class KVConsumer:
    """The decode side: reads a remote prefill's blocks, or counts a local
    prefill when they are gone."""

    def __init__(self) -> None:
        self.transfers = 0
        self.local_prefills = 0

    async def load(self, params: dict, input_ids: list[int], decline: bool = False) -> bool:
        """Read the blocks ``params`` name (``kv_transfer_params`` with
        ``do_remote_prefill``); a producer that cannot be reached, blocks
        that are gone or are not this prompt's mean a local prefill, and so
        does ``decline`` (the blocks are read, which frees them, and
        unused). Returns whether the prompt's KV is used (``False``:
        prefill locally)."""
        try:
            with anyio.fail_after(30):
                stream = await anyio.connect_tcp(str(params["remote_host"]), int(params["remote_port"]))
                async with stream:
                    ask = {"remote_request_id": params["remote_request_id"],
                           "remote_block_ids": params["remote_block_ids"]}
                    await stream.send(orjson.dumps(ask) + b"\n")
                    got = orjson.loads(await BufferedByteReceiveStream(stream).receive_until(b"\n", MAX_LINE))
            if got.get("input_ids") == input_ids and not decline:
                self.transfers += 1
                return True
        except (OSError, TimeoutError, anyio.EndOfStream, anyio.IncompleteRead, anyio.DelimiterNotFound,
                anyio.BrokenResourceError, orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            pass
        self.local_prefills += 1
        return False
