"""The ``asgi-generate`` command: ``serve``, ``sim`` and ``codecs``.

A usage or configuration error is one line on stderr and exit status 2,
before any process starts or any port is bound.
"""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import socket
import sys
from typing import TYPE_CHECKING, Callable

from .. import __version__
from . import detach
from ..config import SETTINGS, Setting, Settings
from .serving import LOG_FORMAT, WORKER_CLASSES, ServerTLS, hold_signals, hypercorn_config, run
from ..exceptions import EngineLoadError
from ..protocols import PROTOCOLS
from ..sdk._versions import VLLM_DEFAULT_VERSION, VLLM_VERSIONS
from ..sim.prefix_cache import DEFAULT_CACHE_TOKENS

if TYPE_CHECKING:
    from ..sim.app import SimApp
    from ..sim.fleet import SimFleet
    from ..sim.tokenizer import SimTokenizer

log = logging.getLogger("asgi_generate")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (argparse prints the
    usage block first, which hides the message in a long command)."""

    def error(self, message: str) -> None:  # noqa: D102 - argparse's hook
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class _Help(argparse.HelpFormatter):
    """Ends every option's help with its default (``none`` when unset)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or not action.option_strings or action.default is argparse.SUPPRESS:
            return text
        if isinstance(action, argparse._VersionAction | argparse._HelpAction):
            return text
        if action.default is None or action.default == []:
            default = "none"
        elif action.default is True or action.default is False:
            default = "on" if action.default else "off"
        else:
            default = "%(default)s"
        return f"{text} (default: {default})"


def _bounded(kind: type, least: float, most: float | None = None):
    """An argparse type: ``kind`` between ``least`` and ``most``."""

    def parse(value: str):
        try:
            number = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not {'an integer' if kind is int else 'a number'}")
        if not (number >= least and (most is None or number <= most)):  # NaN fails too
            span = f"between {least} and {most}" if most is not None else f"{least} or more"
            raise argparse.ArgumentTypeError(f"must be {span}, not {value}")
        return number

    return parse


PORT = _bounded(int, 0, 65535)
#: The most workers ``sim --workers`` serves from one process (a listening
#: socket and a simulated engine each: about 1 MB, see docs/simulator.md).
MAX_SIM_WORKERS = 4096


def _setting_flag(parser: argparse.ArgumentParser, setting: Setting, default: object) -> None:
    """``setting``'s flag (and its old names') on ``parser``, ``default``
    its value when not given (a list flag's value is ``None`` then: given,
    it replaces the default list rather than adding to it)."""
    kwargs: dict[str, object] = {"help": _setting_help(setting, default).replace("%", "%%")}
    if setting.metavar is not None:
        kwargs["metavar"] = setting.metavar
    if setting.item is not None:
        kwargs.update(action="append", type=_argument_type(setting.item), default=None)
    elif setting.kind is bool:
        kwargs.update(action=argparse.BooleanOptionalAction, default=default)
    elif setting.kind in (int, float):
        kwargs.update(type=setting.kind, default=default)
    else:
        kwargs.update(choices=setting.choices or None, default=default)
    parser.add_argument(*setting.flags, dest=setting.name, **kwargs)


def _setting_help(setting: Setting, default: object) -> str:
    """``setting``'s help and its ``default``: ``none``, ``on``/``off`` and
    lists as ``(default: X)``, a value as ``(default X)``, one computed at
    start as ``default <in words> (default X here)``."""
    if "(default" in setting.help:
        return setting.help
    if setting.default_text:
        return f"{setting.help}; default {setting.default_text} (default {setting.text(default)} here)"
    if default is None or isinstance(default, bool | list):
        return f"{setting.help} (default: {setting.shown(default)})"
    return f"{setting.help} (default {setting.text(default)})"


def _argument_type(parse: Callable[[str], object]) -> Callable[[str], object]:
    """An argparse type: ``parse``, its ValueError the flag's error message."""

    def convert(value: str) -> object:
        try:
            return parse(value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def build_parser(d: Settings | None = None) -> argparse.ArgumentParser:
    """The argument parser of every subcommand. ``serve`` has a flag per
    setting (:data:`asgi_generate.config.SETTINGS`), its default ``d``'s
    value (``serve`` passes :meth:`Settings.from_env`, so variables are
    defaults and flags override them), then the server process's own flags."""
    parser = _Parser(
        prog="asgi-generate",
        description="A protocol-level ASGI frontend for LLM engines' native generate APIs.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    d = Settings() if d is None else d

    serve = sub.add_parser("serve", help="serve the frontend under hypercorn", formatter_class=_Help,
                           description="Serve the frontend. Every setting flag also reads its "
                                       "ASGI_GENERATE_* variable (the flag wins); see docs/configuration.md.")
    for setting in SETTINGS.values():
        _setting_flag(serve, setting, getattr(d, setting.name))
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    serve.add_argument("--port", type=PORT, default=8000, help="port to listen on (default %(default)s)")
    serve.add_argument("--fd", type=_bounded(int, 0), default=None,
                       help="serve an inherited listening socket instead of --host/--port")
    _tls_flags(serve)
    serve.add_argument("--worker-class", choices=WORKER_CLASSES, default="asyncio",
                       help="hypercorn worker class; asyncio measured faster than trio, uvloop (asyncio on "
                            "uvloop's loop) faster still (bench/) (default %(default)s)")
    serve.add_argument("--workers", type=_bounded(int, 1), default=1, dest="processes", metavar="WORKERS",
                       help="frontend processes sharing the port (on Linux each with a socket of its own, "
                            "connections spread evenly; an inherited --fd socket is shared unless it has "
                            "SO_REUSEPORT set); each keeps its own /stats (default %(default)s)")
    serve.add_argument("--pid-file", default=None, metavar="PATH",
                       help="write the server's process id here (removed at exit), for "
                            "kill -TERM $(cat PATH)")
    serve.add_argument("--log-file", default=None, metavar="PATH",
                       help="append the server's output here instead of stderr, once the port is bound")
    serve.add_argument("--detach", action="store_true",
                       help="once the port is bound, serve in the background (with --log-file): the command "
                            "exits 0 when the server answers, else with its status and what it logged")
    serve.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True,
                       help="log one line per request (hypercorn's access log format) at INFO")
    serve.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS, default="info",
                       help="logging level (default %(default)s)")

    sim = sub.add_parser("sim", help="run a simulated engine worker", formatter_class=_Help)
    sim_engines = [e.name for e in PROTOCOLS.where(simulated=True)]
    sim.add_argument("--protocol", choices=sim_engines, default=sim_engines[0] if sim_engines else None,
                     help="native protocol to speak")
    sim.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    sim.add_argument("--port", type=PORT, default=30000, help="port to listen on (default %(default)s)")
    sim.add_argument("--fd", type=_bounded(int, 0), default=None, help="serve an inherited listening socket instead")
    sim.add_argument("--workers", type=_bounded(int, 1, MAX_SIM_WORKERS), default=1, metavar="N",
                     help="serve N simulated workers from this one process, each on a port of its own "
                          "(--port, --port + 1, ...; each a free port with --port 0) with its own state, "
                          "faults and counters; prints each worker's URL, one a line; a prefill server's "
                          "bootstrap port is --bootstrap-port + its index (default %(default)s)")
    sim.add_argument("--urls-file", default=None, metavar="PATH",
                     help="also write the workers' URLs here, one a line, once every port is bound")
    _tls_flags(sim, mutual=False)
    sim.add_argument("--ttft-ms", type=_bounded(float, 0), default=0.0, help="time to first token in ms")
    sim.add_argument("--itl-ms", type=_bounded(float, 0), default=0.0, help="inter-token latency in ms")
    sim.add_argument("--incremental-streaming-output", action="store_true",
                     help="SGLang: stream deltas instead of cumulative chunks")
    sim.add_argument("--no-usage-chunk", action="store_true",
                     help="vLLM: never end a stream with the usage chunk, even when asked (as a build "
                          "that ignores stream_options.include_usage)")
    sim.add_argument("--engine-version", default=None, metavar="V",
                     help="engine version to play and report: vLLM answers as that version does (0.25.0 "
                          f"or later; one per behaviour set: {', '.join(VLLM_VERSIONS)}; default "
                          f"{VLLM_DEFAULT_VERSION}, the newest release); SGLang reports it in /get_server_info "
                          "(default: the simulator's own)")
    sim.add_argument("--stream-interval", type=_bounded(int, 1), default=1, metavar="N",
                     help="tokens per streamed event (SGLang --stream-interval; vLLM batches N tokens "
                          "per chunk as under load) (default %(default)s)")
    sim.add_argument("--emit-markers", action="store_true",
                     help="start every answer with <think>...</think> and a hermes "
                          "<tool_call>{json}</tool_call>, then EOS (for reasoning/tool-call traces)")
    sim.add_argument("--abort-after", type=_bounded(int, 0), default=None, metavar="N",
                     help="end every request after N tokens with an abort finish carrying "
                          "--abort-status (default: never)")
    sim.add_argument("--abort-status", type=_bounded(int, 100, 599), default=503, metavar="CODE",
                     help="HTTP status of the --abort-after abort (default %(default)s)")
    sim.add_argument("--disaggregation-mode", choices=("null", "prefill", "decode"), default="null",
                     help="SGLang P/D role: a prefill server hands each request's KV to the decode server "
                          "named in it over its --bootstrap-port (default %(default)s: aggregated)")
    sim.add_argument("--bootstrap-port", type=PORT, default=8998, metavar="B",
                     help="a prefill server's bootstrap port on loopback, 0 = any free one, shown in "
                          "/get_server_info (SGLang "
                          "--disaggregation-bootstrap-port) (default %(default)s)")
    sim.add_argument("--disaggregation-timeout-s", type=_bounded(float, 0.001), default=300.0, metavar="S",
                     help="seconds a prefill room waits for its decode, and a decode request for its KV, "
                          "before SGLang's transfer abort (500) (default %(default)s)")
    sim.add_argument("--kv-role", choices=("producer", "consumer"), default=None,
                     help="vLLM P/D role: a producer (prefill) keeps a finished prefill's KV blocks for the "
                          "consumer (decode) named in kv_transfer_params to read (default: aggregated)")
    sim.add_argument("--kv-expiry-s", type=_bounded(float, 0.001), default=480.0, metavar="S",
                     help="seconds a producer keeps KV blocks no consumer read (vLLM "
                          "VLLM_NIXL_ABORT_REQUEST_TIMEOUT) (default %(default)s)")
    sim.add_argument("--kv-connector", choices=("nixl", "moriio"), default="nixl",
                     help="vLLM: the KV connector a producer plays: nixl hands off a prefill that stopped at its "
                          "length cap or at a stop, moriio at its length cap only (default %(default)s)")
    sim.add_argument("--decode-expert-rows", choices=("sequence", "own"), default="sequence",
                     help="P/D decode's routed experts: sequence (as the engines: every position, zeros where "
                          "it received the KV) or own (only the positions it computed) (default %(default)s)")
    sim.add_argument("--enable-return-routed-experts", action="store_true",
                     help="vLLM: answer each finished choice's routed_experts (base64 .npy rows), as vLLM "
                          "--enable-return-routed-experts does (SGLang requests ask return_routed_experts)")
    sim.add_argument("--disconnect-abort-s", type=_bounded(float, 0), default=2.0, metavar="S",
                     help="SGLang: seconds after a client vanished before the engine aborts its request "
                          "itself, as SGLang's background abort does (default %(default)s)")
    sim.add_argument("--cache-tokens", type=_bounded(int, 0), default=DEFAULT_CACHE_TOKENS, metavar="N",
                     help="prefix cache capacity in tokens, LRU, keyed by SGLang extra_key and cache_salt, vLLM "
                          "cache_salt (SGLang radix cache, vLLM prefix caching in 16-token blocks); 0 = no cache "
                          "(default %(default)s, on as in both engines)")
    sim.add_argument("--block-size", "--page-size", type=_bounded(int, 1), default=None, metavar="N",
                     help="tokens per prefix cache block, the unit of hits and KV events (vLLM --block-size, "
                          "default 16; SGLang --page-size, default 1)")
    sim.add_argument("--kv-events-config", default=None, metavar="JSON",
                     help="publish the prefix cache's KV events over ZMQ, configured as the engine takes it "
                          "(vLLM: {\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\", "
                          "\"replay_endpoint\": ...}; SGLang: {\"publisher\": \"zmq\", \"bind\": true, ...}); "
                          "the PUB socket binds a wildcard endpoint (SGLang: or with bind true) and connects to a "
                          "concrete host, as the engine's; tcp://*:0 binds a free loopback port; discovery: vLLM GET "
                          "/kv_event_sources, SGLang /server_info")
    sim.add_argument("--prefill-us-per-token", type=_bounded(float, 0), default=0.0, metavar="US",
                     help="prefill compute per uncached prompt token in microseconds, one prefill after "
                          "another, added to --ttft-ms (default %(default)s)")
    sim.add_argument("--enable-prompt-tokens-details", action="store_true",
                     help="vLLM: report usage.prompt_tokens_details.cached_tokens (vLLM's server flag)")
    sim.add_argument("--context-length", type=_bounded(int, 1), default=None, metavar="N",
                     help="SGLang: the model's context length, prompt plus max_new_tokens (default 32768)")
    sim.add_argument("--max-model-len", type=_bounded(int, 1), default=None, metavar="N",
                     help="vLLM: the model's context length, prompt plus max_tokens (default 32768)")
    sim.add_argument("--max-logprobs", type=_bounded(int, -1), default=None, metavar="K",
                     help="vLLM: the most logprobs and prompt_logprobs a request may ask, -1 = the vocabulary "
                          "size (default 20)")
    sim.add_argument("--vocab-size", type=_bounded(int, 4096), default=None, metavar="N",
                     help="the model's vocabulary: token ids below it are in vocabulary; past the bundled "
                          "tokenizer's 4096 they are padding, never generated (default 4096)")
    sim.add_argument("--tp-size", type=_bounded(int, 1), default=1, metavar="N",
                     help="tensor-parallel size played: the ranks taken in a weight-update group")
    sim.add_argument("--weights-group-registry", default=None, metavar="PATH",
                     help="a file the fleet's simulators share to refuse overlapping weight-update ranks")
    sim.add_argument("--weight-load-s", type=_bounded(float, 0), default=0.0, metavar="S",
                     help="seconds each weight load takes, the engine busy (SGLang's /health stalls) "
                          "(default %(default)s)")
    cap = sim.add_argument_group(
        "capacity model", "the engine's scheduler (off unless one of these is set; then the step time "
        "alone times tokens, instead of --ttft-ms/--itl-ms/--prefill-us-per-token; see docs/simulator.md)")
    positive = _bounded(int, 1)
    cap.add_argument("--max-running-requests", type=positive, default=None, metavar="N",
                     help="SGLang: requests running at once")
    cap.add_argument("--max-total-tokens", type=positive, default=None, metavar="N",
                     help="SGLang: the KV token pool; decoding requests are retracted when it runs out")
    cap.add_argument("--max-queued-requests", type=_bounded(int, 0), default=None, metavar="N",
                     help="SGLang: waiting requests; past it a request is aborted with 503 "
                          "'The request queue is full.'")
    cap.add_argument("--enable-priority-scheduling", action="store_true",
                     help="SGLang: order the queue by the request's priority (larger first)")
    cap.add_argument("--schedule-low-priority-values-first", action="store_true",
                     help="SGLang: with --enable-priority-scheduling, smaller priority values first")
    cap.add_argument("--disable-priority-preemption", action="store_true",
                     help="SGLang: with --enable-priority-scheduling, never preempt running requests for a "
                          "preferred newcomer")
    cap.add_argument("--priority-scheduling-preemption-threshold", type=int, default=None, metavar="N",
                     help="SGLang: the priority difference a newcomer must exceed to preempt running "
                          "requests (default 10)")
    cap.add_argument("--abort-on-priority-when-disabled", action="store_true",
                     help="SGLang: without --enable-priority-scheduling, abort a request that names a priority")
    cap.add_argument("--max-num-seqs", type=positive, default=None, metavar="N",
                     help="vLLM: sequences running at once (n > 1 counts n)")
    cap.add_argument("--num-gpu-blocks-override", type=positive, default=None, metavar="N",
                     help="vLLM: the KV pool in blocks of --block-size; running requests are preempted "
                          "(recomputed later) when it runs out")
    cap.add_argument("--max-num-batched-tokens", type=positive, default=None, metavar="N",
                     help="vLLM: tokens computed per step (prefills chunked to fit)")
    cap.add_argument("--max-num-queued-reqs", type=_bounded(int, 0), default=None, metavar="N",
                     help="vLLM: requests waiting or running; past it a request is refused with 503")
    cap.add_argument("--max-num-queued-tokens", type=_bounded(int, 0), default=None, metavar="N",
                     help="vLLM: prompt tokens of requests still prefilling; at it a request is refused with 503")
    cap.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                     help="vLLM: the waiting queue's order (priority: smaller first)")
    cap.add_argument("--step-ms", type=_bounded(float, 0), default=None, metavar="MS",
                     help="the fixed cost of each scheduler step")
    cap.add_argument("--step-us-per-seq", type=_bounded(float, 0), default=None, metavar="US",
                     help="each step's cost per sequence in its batch")
    cap.add_argument("--step-us-per-prefill-token", type=_bounded(float, 0), default=None, metavar="US",
                     help="each step's cost per prompt token it computes")
    sim.add_argument("--model-name", default="sim", help="served model name (default %(default)s)")
    sim.add_argument("--parent-pid", type=_bounded(int, 1), default=None, help="exit when this process exits")
    sim.add_argument("--worker-class", choices=WORKER_CLASSES, default="asyncio",
                     help="hypercorn worker class (default %(default)s)")
    sim.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS, default="warning",
                     help="logging level (default %(default)s)")

    sub.add_parser("codecs", help="list the installed codecs")
    sub.add_parser("engines", help="list the installed engine descriptions")
    sub.add_parser("check", help="report how this install hashes: with the C accelerator or in pure Python")
    return parser


def _tls_flags(parser: argparse.ArgumentParser, mutual: bool = True) -> None:
    parser.add_argument("--certfile", default=None, metavar="PATH",
                        help="serve HTTPS with this PEM certificate chain (with --keyfile)")
    parser.add_argument("--keyfile", default=None, metavar="PATH", help="the certificate's PEM private key")
    if mutual:
        parser.add_argument("--ca-certs", default=None, metavar="PATH",
                            help="require client certificates signed by these PEM CAs (mutual TLS)")
        parser.add_argument("--ciphers", default=None, metavar="LIST",
                            help="OpenSSL cipher list for TLS 1.2 (default: hypercorn's ECDHE+AESGCM)")


def _server_tls(args: argparse.Namespace) -> ServerTLS | None:
    """Raises ValueError: see :meth:`ServerTLS.from_flags`."""
    return ServerTLS.from_flags(args.certfile, args.keyfile, getattr(args, "ca_certs", None),
                                getattr(args, "ciphers", None))


def _settings(args: argparse.Namespace, d: Settings) -> Settings:
    """The settings of ``serve``'s flags; ``d``'s lists where a list flag is not given."""
    given = {name: getattr(args, name) for name in SETTINGS}
    return Settings(**{name: getattr(d, name) if value is None else value for name, value in given.items()})


def _fail(message: str) -> int:
    print(f"asgi-generate: {message}", file=sys.stderr)
    return 2


def _serve(args: argparse.Namespace, d: Settings) -> int:
    from .app import App
    from ..ops.metrics import MetricsSetupError, multiproc_dir
    from ..sdk._registry import CodecLoadError, load_codecs
    from .serving import listening_socket
    from .supervisor import supervise
    from ..tracing import Tracer, TraceSetupError

    hold_signals()  # a Ctrl-C while starting up stops cleanly once serving begins
    settings = _settings(args, d)
    # Whatever can be refused is refused here, as one line, before the
    # codecs load, a simulator starts or hypercorn runs.
    try:
        settings.check()
        if args.processes == 1:  # N processes get a folder of serve's own
            multiproc_dir()
        tls = _server_tls(args)
        if args.detach and args.log_file is None:
            raise ValueError("--detach needs --log-file: a server in the background logs there")
    except ValueError as exc:
        return _fail(str(exc))
    try:
        sock = (socket.socket(fileno=args.fd) if args.fd is not None
                else listening_socket(args.host, args.port, reuse_port=args.processes > 1))
    except OSError as exc:
        where = f"fd {args.fd}" if args.fd is not None else f"{args.host}:{args.port}"
        return _fail(f"cannot listen on {where}: {exc.strerror or exc}")
    pid_file = pathlib.Path(args.pid_file) if args.pid_file else None
    try:
        try:
            if args.detach:
                status = detach.fork(args.log_file, args.processes, _where(sock, tls))
                if status is not None:
                    pid_file = None  # the server's to write and remove
                    return status
            elif args.log_file is not None:
                _output_to(args.log_file)
        except OSError as exc:
            pid_file = None
            return _fail(f"--log-file: cannot append to {args.log_file!r}: {exc.strerror or exc}")
        ready = detach.ready_fd()
        try:
            codecs = load_codecs(settings.skip_broken_codecs, protocols=PROTOCOLS)
            if args.processes == 1:
                app = App(settings, codecs)
                if ready is not None:
                    app.on_started = detach.announcer(ready)
            elif settings.trace_file or settings.trace_stderr or settings.otlp_endpoint:
                Tracer(settings)  # fails here, once, rather than in every worker process
        except (CodecLoadError, TraceSetupError, MetricsSetupError) as exc:
            _report_problems(str(exc).splitlines())
            return 2
        if pid_file is not None:
            try:
                pid_file.write_text(f"{os.getpid()}\n")
            except OSError as exc:
                pid_file = None
                return _fail(f"--pid-file: cannot write {args.pid_file!r}: {exc.strerror or exc}")
        log.info("asgi-generate %s: pid %d, listening on %s", __version__, os.getpid(), _where(sock, tls))
        if args.processes > 1:
            protocols = {item.codec.worker_protocol for item in codecs}
            return supervise(settings, sock, args.processes, args.worker_class, args.shutdown_grace, protocols,
                             log_level=args.log_level, access_log=args.access_log, tls=tls, ready_fd=ready)
        # hypercorn's own deadline only backs up the app's: grace, then
        # aborts. hypercorn serves (and closes) the descriptor itself.
        config = hypercorn_config(fd=sock.detach(), graceful_timeout=settings.shutdown_grace + 15.0,
                                  log_level=args.log_level, access_log=args.access_log, tls=tls)
        run(app, config, args.worker_class, settings.header_read_timeout)
        return 0
    finally:
        sock.close()  # a no-op once detached
        if pid_file is not None:
            pid_file.unlink(missing_ok=True)


def _output_to(path: str) -> None:
    """Append this process's stdout and stderr (the log, and its children's
    output) to ``path``.

    Raises:
        OSError: ``path`` cannot be opened for appending.
    """
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)


def _where(sock: socket.socket, tls: ServerTLS | None = None) -> str:
    host, port = sock.getsockname()[:2]
    scheme = "https" if tls is not None else "http"
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def _sim(args: argparse.Namespace) -> int:
    # asyncio warns on every write to a client that hung up; a simulator
    # serving abandoned streams would flood the log with them.
    logging.getLogger("asyncio").setLevel(logging.ERROR)

    try:
        if args.workers > 1 and args.fd is not None:
            raise ValueError("--workers binds a port per worker: use --port, not --fd")
        tls = _server_tls(args)
        # The ports are bound here when their URLs are to be told (a port 0 is known once bound).
        socks = _sim_sockets(args.host, args.port, args.workers) if args.fd is None and (
            args.workers > 1 or args.urls_file) else []
        app = _sim_fleet(args, socks) if args.workers > 1 else _sim_app(args)
    except (ValueError, OSError) as exc:
        print(f"asgi-generate sim: {exc}", file=sys.stderr)
        return 2
    config = hypercorn_config(host=args.host, port=args.port, fd=args.fd, graceful_timeout=1.0,
                              log_level=args.log_level, access_log=False, tls=tls)
    if socks:
        config.bind = [f"fd://{s.fileno()}" for s in socks]
    if args.urls_file:
        if args.fd is not None:
            with socket.socket(fileno=os.dup(args.fd)) as inherited:
                urls = _where(inherited, tls) + "\n"
        else:
            urls = "".join(_where(s, tls) + "\n" for s in socks)
        _write_atomically(args.urls_file, urls)
    if args.workers > 1:
        sys.stdout.write("".join(_where(s, tls) + "\n" for s in socks))
        sys.stdout.flush()
    run(app, config, args.worker_class)
    return 0


def _sim_sockets(host: str, port: int, n: int) -> list[socket.socket]:
    """``n`` listening sockets on ``host``: ports ``port`` .. ``port + n - 1``,
    or ``n`` free ports when ``port`` is 0.

    Raises:
        OSError: a port cannot be bound (every socket bound so far is closed).
    """
    socks: list[socket.socket] = []
    try:
        for i in range(n):
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            socks.append(socket.create_server((host, port + i if port else 0), family=family))
    except OSError:
        for s in socks:
            s.close()
        raise
    return socks


def _write_atomically(path: str, text: str) -> None:
    """Write ``text`` to ``path`` whole: a reader sees nothing or all of it."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _sim_fleet(args: argparse.Namespace, socks: list[socket.socket]) -> "SimFleet":
    """One simulator app per socket in ``socks`` (a prefill server's
    bootstrap port offset by its index), sharing one tokenizer.

    Raises:
        ValueError: a flag value the simulator cannot play.
    """
    from ..sim.fleet import SimFleet
    from ..sim.tokenizer import SimTokenizer

    tokenizer = SimTokenizer()
    workers = {}
    for i, s in enumerate(socks):
        workers[s.getsockname()[1]] = _sim_app(args, i, tokenizer)
    return SimFleet(workers)


def _sim_app(args: argparse.Namespace, index: int = 0, tokenizer: "SimTokenizer | None" = None) -> "SimApp":
    """The simulator app the ``sim`` flags describe: worker ``index`` of
    ``--workers`` (its bootstrap port offset by it; only worker 0 watches
    ``--parent-pid``, whose end ends the whole process).

    Raises:
        ValueError: a flag value the simulator cannot play.
    """
    from ..sim.app import SimApp
    from ..sim.capacity_flags import SGLANG_FLAGS, STEP_FLAGS, VLLM_FLAGS, capacity_config

    block = args.block_size or (16 if args.protocol == "vllm" else 1)
    capacity = capacity_config(args.protocol, block,
                               **{name: getattr(args, name) for name in SGLANG_FLAGS + VLLM_FLAGS + STEP_FLAGS})
    return SimApp(
        protocol=args.protocol,
        ttft_ms=args.ttft_ms,
        itl_ms=args.itl_ms,
        incremental_streaming_output=args.incremental_streaming_output,
        model_name=args.model_name,
        parent_pid=args.parent_pid if index == 0 else None,
        usage_chunk=not args.no_usage_chunk,
        engine_version=args.engine_version,
        stream_interval=args.stream_interval,
        emit_markers=args.emit_markers,
        abort_after=args.abort_after,
        abort_status=args.abort_status,
        disaggregation_mode=args.disaggregation_mode,
        bootstrap_port=args.bootstrap_port + index if args.bootstrap_port else 0,
        disaggregation_timeout_s=args.disaggregation_timeout_s,
        kv_role=args.kv_role,
        kv_expiry_s=args.kv_expiry_s,
        kv_connector=args.kv_connector,
        decode_expert_rows=args.decode_expert_rows,
        disconnect_abort_s=args.disconnect_abort_s,
        routed_experts=args.enable_return_routed_experts,
        cache_tokens=args.cache_tokens,
        prefill_us_per_token=args.prefill_us_per_token,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        context_length=args.context_length,
        max_model_len=args.max_model_len,
        max_logprobs=args.max_logprobs,
        vocab_size=args.vocab_size,
        block_size=args.block_size,
        kv_events_config=args.kv_events_config,
        tp_size=args.tp_size,
        weights_group_registry=args.weights_group_registry,
        weight_load_s=args.weight_load_s,
        capacity=capacity,
        tokenizer=tokenizer,
    )


def _report_problems(lines: list[str]) -> None:
    for line in lines:
        print(f"asgi-generate: {line}", file=sys.stderr)


def _codecs() -> int:
    """List every codec that loads; name each that does not, and each
    collision, on stderr and exit 2 (``serve`` would refuse to start)."""
    from ..sdk._registry import discover

    found = discover(PROTOCOLS)
    rows = [("NAME", "ROUTES", "WORKER PROTOCOL", "DISTRIBUTION", "VERSION")]
    for item in found.loaded:
        routes = ", ".join(f"{r.method} {r.path}" for r in item.codec.routes)
        rows.append((item.codec.name, routes, item.codec.worker_protocol, item.distribution, item.version))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    problems = [*map(str, found.failures), *found.collisions]
    _report_problems(problems)
    return 2 if problems else 0


def _engines() -> int:
    """List every installed engine description (the ``asgi_generate.engines``
    entry points): its name, P/D handshake (``-`` for none), whether
    ``asgi-generate sim`` plays it, and its generate route (:func:`main`
    names each that does not load, first)."""
    rows = [("NAME", "P/D", "SIMULATED", "GENERATE")]
    rows += [(e.name, e.pd or "-", "yes" if e.simulated else "no", e.generate_path) for e in PROTOCOLS.values()]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    return 0


def _check() -> int:
    """Print this install's version and whether the hash chains run in C
    (``hash_accelerator``, as ``/stats`` says it; :data:`asgi_generate.hashes.ACCELERATED`)
    as one JSON object, e.g. ``{"version":"0.1.0","hash_accelerator":true}``."""
    import orjson

    from .. import hashes

    print(orjson.dumps({"version": __version__, "hash_accelerator": hashes.ACCELERATED}).decode())
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``asgi-generate`` console script."""
    argv = sys.argv[1:] if argv is None else argv
    try:  # the engine descriptions, before any flag or worker spec is read against them
        list(PROTOCOLS)
    except EngineLoadError as exc:
        _report_problems(str(exc).splitlines())
        return 2
    d = Settings()
    if argv[:1] == ["serve"]:
        try:  # the variables are serve's defaults, exactly as under hypercorn
            d = Settings.from_env()
        except ValueError as exc:
            return _fail(str(exc))
    args = build_parser(d).parse_args(argv)
    if args.command == "codecs":
        return _codecs()
    if args.command == "engines":
        return _engines()
    if args.command == "check":
        return _check()
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    if args.command == "serve":
        return _serve(args, d)
    return _sim(args)
