"""hypercorn's asyncio worker (hypercorn 0.18.0) with one ``asyncio.Protocol``
per client connection, installed by
:func:`asgi_generate.server.hypercorn.patches.install`: on the asyncio and
uvloop worker classes alike, whether ``asgi-generate serve`` or a
``hypercorn`` command runs the app.

hypercorn serves each connection with a ``StreamReader``/``StreamWriter``
pair (``asyncio.start_server`` in ``hypercorn/asyncio/run.py``) and a task
that loops reading it (``TCPServer`` in ``hypercorn/asyncio/tcp_server.py``),
under an ``asyncio.TaskGroup``, with a send lock and a keep-alive task.
:class:`Connection` instead holds about 5.5 KB less per open SSE stream
(UPSTREAM.md, "Per-connection memory"). It is the same connection as a
protocol: the transport calls it with the bytes read, it writes with
``transport.write`` and waits only while the transport has paused writing
(a full socket buffer). hypercorn's protocol classes (``H11Protocol``,
``H2Protocol`` for ``h2`` by ALPN or upgrade, in hypercorn's
``ProtocolWrapper``, with :mod:`asgi_generate.server.hypercorn.fixes`'
changes) are driven as before.

Their ``handle()`` is a coroutine that nearly always finishes without
suspending: :func:`_step` runs it to its end right in the transport's
callback. When it does suspend (a write waiting for the socket's buffer, h11
waiting for the answer before it parses a pipelined request), a task takes
over where it stopped, the transport stops reading, and what arrives meanwhile
(the end of the stream included) is handled by that task, in order, before
reading resumes. Exceptions and cancellation reach the coroutine as they would
in a task of its own.

Kept from hypercorn: the keep-alive timeout (a timer while a connection is
idle, none while it serves a request), ``connection: close`` and the
per-connection request limit (the protocol's), a connection closed once the
client's end of stream is read and the app is done (the fix of
bug 1 of :mod:`asgi_generate.server.hypercorn.fixes`: no keep-alive wait for a client that is
gone), a write to a closed connection reported to the protocol as
``Closed``, TLS (hypercorn's SSL context and handshake timeout), graceful
shutdown (idle connections close, busy ones close after their answer, for at
most ``graceful_timeout`` seconds), the lifespan, ``max_requests``. Added:
the app told as the graceful shutdown begins, a connection on which a request
has begun not taken for an idle one then (:mod:`.graceful`), and the request
head's deadline (:class:`asgi_generate.server.hypercorn.fixes.HeadDeadline`:
the keep-alive timer armed with it instead while a head is due).
"""

from __future__ import annotations

import asyncio
import collections.abc
import platform
import random
import signal
from collections.abc import Awaitable, Callable, Coroutine
from functools import partial
from typing import Any

from hypercorn.asyncio import run as asyncio_run
from hypercorn.asyncio.lifespan import Lifespan
from hypercorn.asyncio.statsd import StatsdLogger
from hypercorn.asyncio.udp_server import UDPServer
from hypercorn.asyncio.worker_context import WorkerContext
from hypercorn.config import Config, Sockets
from hypercorn.events import Closed, Event, RawData, Updated
from hypercorn.protocol import ProtocolWrapper
from hypercorn.utils import ShutdownError, parse_socket_addr, raise_shutdown, repr_socket_addr, wrap_app

from . import fixes, graceful, lean
from .. import spread

#: "Nothing": a coroutine that finished (:func:`_step`), a yield handed on (:class:`_Resumed`).
_NOTHING = object()


def _connection_lost() -> ConnectionResetError:
    return ConnectionResetError("Connection lost")


def _call_soon(loop: asyncio.AbstractEventLoop, func: Callable, *args: Any) -> Any:
    # hypercorn's call_soon for the app (hypercorn/asyncio/task_group.py),
    # from another thread: func(*args) run on the loop, its result awaited.
    return asyncio.run_coroutine_threadsafe(func(*args), loop).result()


def _step(coro: Coroutine) -> Any:
    """Run ``coro`` until it finishes (``_NOTHING``) or suspends (what it
    yielded, for :class:`_Resumed`). Its exception propagates."""
    try:
        return coro.send(None)
    except StopIteration:
        return _NOTHING


class _Resumed(collections.abc.Coroutine):
    """A task's coroutine that carries on ``coro``, which :func:`_step` left
    suspended on ``yielded``: the task's first step gets that same yield,
    then every send and throw (cancellation, also before the first step)
    goes to ``coro``, as if the task had run it from its start."""

    __slots__ = ("coro", "yielded")

    def __init__(self, coro: Coroutine, yielded: Any) -> None:
        self.coro = coro
        self.yielded = yielded

    def send(self, value: Any) -> Any:
        if self.yielded is not _NOTHING:
            yielded, self.yielded = self.yielded, _NOTHING
            return yielded
        return self.coro.send(value)

    def throw(self, *exc: Any) -> Any:
        self.yielded = _NOTHING
        return self.coro.throw(*exc)

    def close(self) -> None:
        self.coro.close()

    def __next__(self) -> Any:  # the task's send(None)
        return self.send(None)

    def __iter__(self) -> "_Resumed":
        return self

    def __await__(self) -> "_Resumed":
        return self


class _Worker:
    """What every connection of one worker shares: the app, config, worker
    context, lifespan state, the count of open connections and the idle
    ones (for the graceful shutdown)."""

    __slots__ = ("app", "config", "context", "state", "loop", "open", "idle", "emptied")

    def __init__(self, app: Any, config: Config, context: WorkerContext, state: dict,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.app = app
        self.config = config
        self.context = context
        self.state = state
        self.loop = loop
        self.open = 0
        #: Connections waiting for a request (a keep-alive timer each).
        self.idle: set[Connection] = set()
        self.emptied: asyncio.Future | None = None

    def closed(self) -> None:
        self.open -= 1
        if spread.current is not None:
            spread.current.closed()
        if not self.open and self.emptied is not None and not self.emptied.done():
            self.emptied.set_result(None)

    async def drain(self, timeout: float) -> None:
        """Close the idle connections, then wait up to ``timeout`` seconds
        for the others to finish their answers and close."""
        for conn in list(self.idle):
            conn._idle_timeout()
        if self.open:
            self.emptied = self.loop.create_future()
            try:
                await asyncio.wait_for(asyncio.shield(self.emptied), timeout)
            except asyncio.TimeoutError:
                pass


class Connection(asyncio.Protocol):
    """One client connection: hypercorn's ``TCPServer`` (asyncio) as a
    protocol, and the task group its protocol spawns the app calls in.

    Events reach ``self.protocol.handle()`` in the order they happened; a
    ``handle()`` that suspends runs on in a task (module docstring)."""

    __slots__ = ("worker", "transport", "protocol", "_queued", "_tasks", "_idle", "_heading", "_drain",
                 "_writing_paused", "_reading_done", "_lost", "_ended", "_ssl")

    def __init__(self, worker: _Worker) -> None:
        self.worker = worker
        self.transport: asyncio.Transport | None = None
        self.protocol: Any = None
        #: Events that arrived while a handle() is suspended (None: none is).
        self._queued: list[Event] | None = None
        #: Its live tasks: None, one, or a list of several.
        self._tasks: asyncio.Task | list[asyncio.Task] | None = None
        #: The keep-alive timer while the connection is idle, or the
        #: request head's deadline (``_heading``) while a head is due.
        self._idle: asyncio.TimerHandle | None = None
        self._heading = False
        #: Futures of writes waiting for the transport to resume writing.
        self._drain: list[asyncio.Future] | None = None
        self._writing_paused = False
        self._reading_done = False
        self._lost = False
        #: Lost, and its tasks done: no longer counted open.
        self._ended = False
        self._ssl = False

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        worker = self.worker
        worker.open += 1
        if spread.current is not None:
            spread.current.opened()
        sock = transport.get_extra_info("socket")
        try:
            client = parse_socket_addr(sock.family, sock.getpeername())
            here = parse_socket_addr(sock.family, sock.getsockname())
        except OSError:  # the client is gone already
            transport.abort()
            return
        ssl_object = transport.get_extra_info("ssl_object")
        self._ssl = ssl_object is not None
        alpn = ssl_object.selected_alpn_protocol() if self._ssl else "http/1.1"
        self.protocol = ProtocolWrapper(worker.app, worker.config, worker.context, self, worker.state,
                                        self._ssl, client, here, self.send, alpn)
        self._run(self.protocol.initiate())  # HTTP/1.1: the first head's deadline (fixes.HeadDeadline)
        if worker.context.terminated.is_set():
            self._idle_timeout()
        elif not self._lost and self._idle is None:
            self._start_idle()

    def data_received(self, data: bytes) -> None:
        self._feed(RawData(data))

    def eof_received(self) -> bool:
        self._end_of_stream()
        return not self._ssl  # keep writing the answer after a half-close (not over TLS)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._writing_paused = False
        waiters, self._drain = self._drain, None
        lean.wake_all(waiters, _connection_lost)
        self._end_of_stream()
        self._finish()

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        waiters, self._drain = self._drain, None
        lean.wake_all(waiters)

    # Reading: events to the protocol, in order

    def _end_of_stream(self) -> None:
        if self._reading_done:
            return
        self._reading_done = True
        self._stop_idle()
        self._feed(RawData(b""))
        self._feed(Closed())
        self._finish()

    def _feed(self, event: Event) -> None:
        if self._queued is not None:
            self._queued.append(event)
        elif self.protocol is not None:
            self._run(self.protocol.handle(event))

    def _run(self, coro: Coroutine) -> bool:
        # True: it finished; else it failed or runs on in a task, and events
        # queue (reading paused) until that task is done.
        try:
            yielded = _step(coro)
        except Exception as exc:
            self._failed(exc)
            return False
        if yielded is _NOTHING:
            return True
        if self._queued is None:
            self._queued = []
            self.transport.pause_reading()
        self.spawn(_Resumed, coro, yielded).add_done_callback(self._resumed)
        return False

    def _resumed(self, task: asyncio.Task) -> None:
        # The suspended handle() is done (a failure is _task_done's): the
        # events that came meanwhile, in order, then reading again.
        if not task.cancelled() and task.exception() is None:
            while self._queued:
                if not self._run(self.protocol.handle(self._queued.pop(0))):
                    return
            if not self._reading_done:
                self.transport.resume_reading()
        self._queued = None
        self._finish()

    def _failed(self, exc: BaseException) -> None:
        # As a failing TCPServer.run: the app calls cancelled, the socket closed.
        if not isinstance(exc, OSError):
            self.worker.loop.call_exception_handler(
                {"message": "hypercorn connection failed", "exception": exc, "protocol": self})
        for task in self._task_list():
            task.cancel()
        self._close()

    # Writing: hypercorn's TCPServer.protocol_send

    async def send(self, event: Event) -> None:
        """hypercorn's ``TCPServer.protocol_send``: ``RawData`` written (then
        waits while the transport's buffer is full), ``Closed`` closes the
        connection, ``Updated`` starts or stops the keep-alive timer,
        :class:`~asgi_generate.server.hypercorn.fixes.HeadDeadline` arms it
        with the request head's deadline instead (once per head). A
        write to a connection that is closed or closing tells the protocol
        it is ``Closed``."""
        if isinstance(event, RawData):
            if self._lost or self.transport.is_closing():
                await self.protocol.handle(Closed())
                return
            try:
                self.transport.write(event.data)
                if self._writing_paused:
                    await self._wait_writable()
            except (ConnectionError, RuntimeError):
                await self.protocol.handle(Closed())
        elif isinstance(event, Closed):
            self._close()
        elif isinstance(event, Updated):
            self._stop_idle()
            if event.idle and not self._reading_done:
                if self.worker.context.terminated.is_set():
                    self._idle_timeout()
                else:
                    self._start_idle()
        elif isinstance(event, fixes.HeadDeadline):
            if self._heading or self._reading_done or self._lost:
                return
            if self.worker.context.terminated.is_set():
                self._idle_timeout()
                return
            self._stop_idle()
            self._idle = self.worker.loop.call_later(fixes.header_read_timeout, self._head_timeout)
            self._heading = True
            self.worker.idle.add(self)  # closed, as an idle one, when the server shuts down

    async def _wait_writable(self) -> None:
        if self._drain is None:
            self._drain = []
        await lean.wait_future(self._drain)

    def _close(self) -> None:
        self._stop_idle()
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        try:
            if transport.can_write_eof():
                transport.write_eof()
        except (NotImplementedError, OSError, RuntimeError):
            pass
        transport.close()

    def reset(self) -> None:
        """Close the connection at once with a TCP reset, dropping what is
        buffered for the client (the app cut it off): the protocol hears
        ``Closed`` from the transport, and writes waiting on it end."""
        if self._lost or self.transport is None:
            return
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            fixes.reset_on_close(sock)
        self.transport.abort()

    def _start_idle(self) -> None:
        self._idle = self.worker.loop.call_later(self.worker.config.keep_alive_timeout, self._idle_timeout)
        self.worker.idle.add(self)

    def _stop_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
            self._heading = False
            self.worker.idle.discard(self)

    def _head_timeout(self) -> None:
        # The request head's deadline: the protocol answers (or not) and
        # closes; with the transport's buffer full (a client that does not
        # read), unanswered and reset, not left to drain.
        self._idle = None
        self._heading = False
        self.worker.idle.discard(self)
        writable = not self._writing_paused
        if not writable:
            self.reset()
        self._feed(fixes.HeadTimedOut(writable))

    def _idle_timeout(self) -> None:
        # Idle past keep_alive_timeout, or the server is shutting down; in a
        # shutdown, a request begun on it is read and answered first
        # (graceful.request_begun). close() stops reading at once: nothing
        # more is read from it.
        if self.worker.context.terminated.is_set() and (
                self._queued is not None or graceful.request_begun(self.protocol, self._fd())):
            return  # its timer (a head's deadline, if one is due) still runs
        self._stop_idle()
        self.transport.close()

    def _fd(self) -> int:
        sock = self.transport.get_extra_info("socket")
        return -1 if sock is None else sock.fileno()

    def _finish(self) -> None:
        # As TCPServer.run's end: once the client's end of stream is read and
        # the app calls are done, the socket closes; once it has, it is gone.
        if self._tasks or self._queued is not None:
            return
        if self._lost:
            if not self._ended:
                self._ended = True
                self.worker.closed()
        elif self._reading_done:
            self._close()

    # hypercorn's TaskGroup

    async def spawn_app(self, app: Any, config: Config, scope: dict,
                        send: Callable[[Any], Awaitable[None]]) -> Callable[[Any], Awaitable[None]]:
        """hypercorn's ``TaskGroup.spawn_app`` with
        :class:`asgi_generate.server.hypercorn.lean.AppQueue` for its queue."""
        queue = lean.AppQueue(config.max_app_queue_size)
        loop = self.worker.loop
        call = app(scope, queue.get, send, partial(loop.run_in_executor, None), partial(_call_soon, loop))
        self.spawn(self._call_app, call, send)
        return queue.put

    async def _call_app(self, call: Awaitable[None], send: Callable[[Any], Awaitable[None]]) -> None:
        # hypercorn's _handle (hypercorn/asyncio/task_group.py) with the app
        # called already: a smaller frame for as long as the request lives.
        try:
            await call
        except asyncio.CancelledError:
            raise
        except Exception:
            await self.worker.config.log.exception("Error in ASGI Framework")
        finally:
            await send(None)

    def spawn(self, func: Callable, *args: Any) -> asyncio.Task:
        """Run ``func(*args)`` in a task of this connection: the connection
        closes only once its tasks are done, and they are cancelled if it
        fails."""
        task = self.worker.loop.create_task(func(*args))
        if self._tasks is None:
            self._tasks = task
        elif type(self._tasks) is list:
            self._tasks.append(task)
        else:
            self._tasks = [self._tasks, task]
        task.add_done_callback(self._task_done)
        return task

    def _task_list(self) -> list[asyncio.Task]:
        tasks = self._tasks
        return [] if tasks is None else tasks if type(tasks) is list else [tasks]

    def _task_done(self, task: asyncio.Task) -> None:
        if self._tasks is task:
            self._tasks = None
        else:
            self._tasks.remove(task)
            if len(self._tasks) == 1:
                self._tasks = self._tasks[0]
        if not task.cancelled() and task.exception() is not None:
            self._failed(task.exception())
        self._finish()


async def worker_serve(app: Any, config: Config, *, sockets: Sockets | None = None,
                       shutdown_trigger: Callable[..., Awaitable] | None = None) -> None:
    """hypercorn's asyncio ``worker_serve`` with :class:`Connection` for its
    TCP connections (``app`` is hypercorn's app wrapper; the rest as
    hypercorn's). Without a ``shutdown_trigger`` it serves until SIGINT or
    SIGTERM."""
    config.set_statsd_logger_class(StatsdLogger)
    loop = asyncio.get_running_loop()
    if shutdown_trigger is None:
        signal_event = asyncio.Event()
        for name in ("SIGINT", "SIGTERM"):
            loop.add_signal_handler(getattr(signal, name), signal_event.set)
        shutdown_trigger = signal_event.wait

    lifespan_state: dict = {}
    lifespan = Lifespan(app, config, loop, lifespan_state)
    lifespan_task = loop.create_task(lifespan.handle_lifespan())
    await lifespan.wait_for_startup()
    if lifespan_task.done():
        exception = lifespan_task.exception()
        if exception is not None:
            raise exception

    if sockets is None:
        sockets = config.create_sockets()
    ssl_context = config.create_ssl_context() if config.ssl_enabled else None
    max_requests = None
    if config.max_requests is not None:
        max_requests = config.max_requests + random.randint(0, config.max_requests_jitter)
    context = lean.AsyncioWorkerContext(max_requests)
    worker = _Worker(app, config, context, lifespan_state, loop)
    udp_tasks: set[asyncio.Task] = set()

    servers = []
    for secure, socks in ((True, sockets.secure_sockets), (False, sockets.insecure_sockets)):
        for sock in socks:
            if config.workers > 1 and platform.system() == "Windows":
                sock = asyncio_run._share_socket(sock)
            tls = {"ssl": ssl_context, "ssl_handshake_timeout": config.ssl_handshake_timeout} if secure else {}
            servers.append(await loop.create_server(lambda: Connection(worker), sock=sock,
                                                    backlog=config.backlog, **tls))
            bind = repr_socket_addr(sock.family, sock.getsockname())
            await config.log.info(f"Running on {'https' if secure else 'http'}://{bind} (CTRL + C to quit)")
    for sock in sockets.quic_sockets:
        _, udp = await loop.create_datagram_endpoint(
            lambda: UDPServer(app, loop, config, context, lifespan_state), sock=sock)
        task = loop.create_task(udp.run())
        udp_tasks.add(task)
        task.add_done_callback(udp_tasks.discard)
        bind = repr_socket_addr(sock.family, sock.getsockname())
        await config.log.info(f"Running on https://{bind} (QUIC) (CTRL + C to quit)")

    try:
        async with asyncio.TaskGroup() as task_group:
            task_group.create_task(raise_shutdown(graceful.announcing(app, config, shutdown_trigger)))
            task_group.create_task(raise_shutdown(context.terminate.wait))
    except BaseExceptionGroup as error:
        _, other_errors = error.split((ShutdownError, KeyboardInterrupt))
        if other_errors is not None:
            raise other_errors
    except (ShutdownError, KeyboardInterrupt):
        pass
    finally:
        await context.terminated.set()
        for server in servers:
            server.close()  # (its wait_closed() would wait for every connection on Python 3.12+)
        try:
            await worker.drain(config.graceful_timeout)
            if udp_tasks:
                await asyncio.wait(udp_tasks, timeout=config.graceful_timeout)
        finally:
            await lifespan.wait_for_shutdown()
            lifespan_task.cancel()
            await lifespan_task


async def serve(app: Any, config: Config, *,
                shutdown_trigger: Callable[..., Awaitable] | None = None) -> None:
    """hypercorn's ``hypercorn.asyncio.serve`` on :func:`worker_serve`."""
    await worker_serve(wrap_app(app, config.wsgi_max_body_size, None), config, shutdown_trigger=shutdown_trigger)
