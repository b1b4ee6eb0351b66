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
from typing import TYPE_CHECKING

from .. import __version__
from ..config import Settings
from .serving import WORKER_CLASSES, ServerTLS, hold_signals, hypercorn_config, run
from ..workers.policies import POLICIES
from ..workers.protocols import PROTOCOLS
from ..workers.router import DISAGGREGATION_MODES, parse_worker_spec
from ..sdk.versions import VLLM_DEFAULT_VERSION, VLLM_VERSIONS

if TYPE_CHECKING:
    from ..sim.app import SimApp

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


def _worker_spec(value: str, role: str = "aggregated") -> tuple[str, str]:
    try:
        return parse_worker_spec(value, role)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _prefill_spec(value: str) -> tuple[str, str]:
    return _worker_spec(value, "prefill")


def _decode_spec(value: str) -> tuple[str, str]:
    return _worker_spec(value, "decode")


def build_parser(d: Settings | None = None) -> argparse.ArgumentParser:
    """The argument parser of every subcommand; ``d`` gives ``serve``'s
    defaults (``serve`` passes :meth:`Settings.from_env`, so variables are
    defaults and flags override them)."""
    parser = _Parser(
        prog="asgi-generate",
        description="A protocol-level ASGI frontend for LLM engines' native generate APIs.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    d = Settings() if d is None else d

    serve = sub.add_parser("serve", help="serve the frontend under hypercorn", formatter_class=_Help,
                           description="Serve the frontend. Every setting flag also reads its "
                                       "ASGI_GENERATE_* variable (the flag wins); see README.md.")
    serve.add_argument("--worker", action="append", type=_worker_spec, default=None, metavar="PROTOCOL=URL",
                       help="an engine worker, PROTOCOL sglang or vllm, e.g. sglang=http://127.0.0.1:30000, or "
                            "sglang=dns://NAME:PORT for every address NAME resolves to (repeat for more); with none, simulated workers are started (default: "
                            + (",".join(f"{p}={u}" for p, u in d.workers) or "none") + ")")
    serve.add_argument("--prefill", action="append", type=_prefill_spec, default=None, metavar="PROTOCOL=URL",
                       help="a P/D prefill worker, e.g. sglang=http://127.0.0.1:30000?bootstrap_port=8998 "
                            "(bootstrap port default 8998; repeat for more) (default: "
                            + (",".join(f"{p}={u}" for p, u in d.prefill) or "none") + ")")
    serve.add_argument("--decode", action="append", type=_decode_spec, default=None, metavar="PROTOCOL=URL",
                       help="a P/D decode worker, e.g. sglang=http://127.0.0.1:30001 (repeat for more) (default: "
                            + (",".join(f"{p}={u}" for p, u in d.decode) or "none") + ")")
    serve.add_argument("--disaggregation", choices=DISAGGREGATION_MODES, default=d.disaggregation,
                       help="auto: a request runs as a prefill/decode pair when its protocol has both up, "
                            "else on an aggregated worker; always: pairs only; never: aggregated only "
                            "(default %(default)s)")
    serve.add_argument("--pd-fallback", action=argparse.BooleanOptionalAction, default=d.pd_fallback,
                       help="vLLM P/D: when the prefill worker answers no kv_transfer_params (it stopped "
                            "before its one-token cap), let the decode worker prefill alone (recorded as "
                            "local_prefill) instead of failing the request (default %(default)s)")
    serve.add_argument("--policy", choices=POLICIES, default=d.policy,
                       help="routing policy: least outstanding requests, session affinity (rendezvous "
                            "hashing on a session header, bounded load) or cache-aware (longest prefix "
                            "match, least outstanding when load is imbalanced) (default %(default)s)")
    serve.add_argument("--session-headers", default=d.session_headers, metavar="NAMES",
                       help="session policy: comma-separated headers the session key is read from, the "
                            "first present wins (default %(default)s)")
    serve.add_argument("--session-balance-epsilon", type=float, default=d.session_balance_epsilon,
                       metavar="E",
                       help="session policy: a worker takes keyed requests while its outstanding count is "
                            "below ceil((1 + E) x (all outstanding + 1) / workers) (default %(default)s)")
    serve.add_argument("--cache-threshold", type=float, default=d.cache_threshold,
                       help="cache-aware policy: share of the prompt (0-1) the longest cached prefix must "
                            "exceed to route by it (default %(default)s)")
    serve.add_argument("--balance-abs-threshold", type=int, default=d.balance_abs_threshold,
                       help="cache-aware policy: load is imbalanced when the most and fewest outstanding "
                            "requests differ by more than this... (default %(default)s)")
    serve.add_argument("--balance-rel-threshold", type=float, default=d.balance_rel_threshold,
                       help="...and the most exceeds this times the fewest (default %(default)s)")
    serve.add_argument("--max-tree-tokens", type=int, default=d.max_tree_tokens,
                       help="cache-aware policy: tokens (text: characters) each worker's prefix tree holds; "
                            "least recently used leaves are evicted past it (default %(default)s)")
    serve.add_argument("--max-tree-nodes", type=int, default=d.max_tree_nodes,
                       help="cache-aware policy: nodes each worker's prefix tree holds (default %(default)s)")
    serve.add_argument("--workers-file", default=d.workers_file, metavar="PATH",
                       help="a JSON (or .toml) file with lists workers, prefill and decode of PROTOCOL=URL "
                            "specs, reread when it changes; workers that leave it drain")
    serve.add_argument("--discovery-interval", type=float, default=d.discovery_interval, metavar="S",
                       help="seconds between DNS lookups of dns:// workers and checks of --workers-file "
                            "(default %(default)s)")
    serve.add_argument("--worker-ca-file", default=d.worker_ca_file, metavar="PATH",
                       help="PEM CA bundle that https:// workers' certificates are verified against (only it "
                            "is trusted; default: the system's CAs)")
    serve.add_argument("--worker-insecure", action=argparse.BooleanOptionalAction, default=d.worker_insecure,
                       help="do not verify https:// workers' certificates (testing only; logged as a warning)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    serve.add_argument("--port", type=PORT, default=8000, help="port to listen on (default %(default)s)")
    serve.add_argument("--fd", type=_bounded(int, 0), default=None,
                       help="serve an inherited listening socket instead of --host/--port")
    _tls_flags(serve)
    serve.add_argument("--worker-class", choices=WORKER_CLASSES, default="asyncio",
                       help="hypercorn worker class; asyncio measured faster than trio, uvloop (asyncio on "
                            "uvloop's loop) faster still (bench/) (default %(default)s)")
    serve.add_argument("--workers", type=_bounded(int, 1), default=1,
                       help="frontend processes sharing the port; each keeps its own /stats "
                            "(default %(default)s)")
    serve.add_argument("--pid-file", default=None, metavar="PATH",
                       help="write the server's process id here (removed at exit), for "
                            "kill -TERM $(cat PATH)")
    serve.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True,
                       help="log one line per request (hypercorn's access log format) at INFO")
    serve.add_argument("--shutdown-grace", type=float, default=d.shutdown_grace,
                       help="seconds in-flight requests get to finish on SIGTERM/SIGINT before they are "
                            "aborted and ended cleanly (default %(default)s)")
    serve.add_argument("--slow-client-timeout", type=float, default=d.slow_client_timeout,
                       help="seconds a client may leave a write untaken before it is cut off and the "
                            "engine aborted (default %(default)s)")
    serve.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                       help="request body cap in bytes; larger bodies get 413 (default %(default)s)")
    serve.add_argument("--body-budget-bytes", type=int, default=d.body_budget_bytes,
                       help="request body bytes read and decoded at once over all requests (a chunked body "
                            "counts as --max-body-bytes); more wait, then get 503 with Retry-After; default "
                            "1/128 of physical memory within [64 MiB, 512 MiB] (default %(default)s here)")
    serve.add_argument("--body-budget-wait", type=float, default=d.body_budget_wait,
                       help="seconds a request may wait for room in the body budget before its 503 "
                            "(default %(default)s)")
    serve.add_argument("--body-read-timeout", type=float, default=d.body_read_timeout,
                       help="seconds a client has to send its whole body; a stalled upload gets 408 "
                            "(default %(default)s)")
    serve.add_argument("--connect-timeout", type=float, default=d.connect_timeout,
                       help="seconds to connect to a worker (default %(default)s)")
    serve.add_argument("--headers-timeout", type=float, default=d.headers_timeout,
                       help="seconds from sending a streamed engine leg to its response headers; "
                            "0 = none (default %(default)s)")
    serve.add_argument("--first-token-timeout", type=float, default=d.first_token_timeout,
                       help="seconds from a streamed leg's headers to its first event (queueing and "
                            "prefill); 0 = none (default %(default)s)")
    serve.add_argument("--inter-token-timeout", "--read-timeout", type=float, default=d.inter_token_timeout,
                       help="seconds a streamed leg may go without an SSE event (comments do not count); "
                            "0 = none; --read-timeout is its old name (default %(default)s)")
    serve.add_argument("--request-timeout", type=float, default=d.request_timeout,
                       help="seconds a unary engine leg may take in all; 0 = none (default %(default)s)")
    serve.add_argument("--migration-limit", type=_bounded(int, 0), default=d.migration_limit, metavar="N",
                       help="resumed attempts a stream may make after its first when workers die "
                            "mid-answer; 0 = no migration (default %(default)s)")
    serve.add_argument("--health-interval", type=float, default=d.health_interval,
                       help="seconds between health probes of each worker (default %(default)s)")
    serve.add_argument("--health-timeout", type=float, default=d.health_timeout,
                       help="seconds one health probe may take (default %(default)s)")
    serve.add_argument("--health-failures", type=int, default=d.health_failures,
                       help="failed health probes in a row that take an up worker out of the rotation "
                            "and end its in-flight requests; a refused or broken connection does at once "
                            "(default %(default)s)")
    serve.add_argument("--sse-keepalive", type=float, default=d.sse_keepalive,
                       help="seconds of stream silence before a keep-alive comment; 0 = never (default %(default)s)")
    serve.add_argument("--abort-timeout", type=float, default=d.abort_timeout,
                       help="seconds an engine has to answer an abort request; a slow one is never re-sent, "
                            "a non-200 answer is retried (default %(default)s)")
    serve.add_argument("--abort-concurrency", type=int, default=d.abort_concurrency,
                       help="abort requests in flight at once per worker, each on its own kept-alive "
                            "connection (default %(default)s)")
    serve.add_argument("--abort-queue-size", type=int, default=d.abort_queue_size,
                       help="aborts that may wait per worker; more are refused and counted "
                            "unacknowledged (default %(default)s)")
    serve.add_argument("--abort-batch", type=int, default=d.abort_batch,
                       help="engine ids per abort request where the engine takes a list (vLLM "
                            "/abort_requests) (default %(default)s)")
    serve.add_argument("--abort-deadline", type=float, default=d.abort_deadline,
                       help="seconds a request's end waits, at most, for its aborts' answers, queueing "
                            "included (default %(default)s)")
    serve.add_argument("--admin-token", default=d.admin_token, metavar="TOKEN",
                       help="require 'Authorization: Bearer TOKEN' on admin routes (default: open; "
                            "prefer the variable, which ps does not show)")
    serve.add_argument("--admin-timeout", type=float, default=d.admin_timeout,
                       help="seconds an admin route waits for each worker's answer (default %(default)s)")
    serve.add_argument("--embedded-workers", type=int, default=d.embedded_workers,
                       help="simulated workers started when no --worker is given (default %(default)s)")
    serve.add_argument("--embedded-pd", action=argparse.BooleanOptionalAction, default=d.embedded_pd,
                       help="with the simulated workers, also start a prefill and a decode simulator per "
                            "protocol, so requests run as P/D pairs (default %(default)s)")
    serve.add_argument("--split-batches", action=argparse.BooleanOptionalAction, default=d.split_batches,
                       help="spread a batch's prompts over the workers instead of sending it to one worker as "
                            "one engine request (default %(default)s)")
    serve.add_argument("--embedded-ttft-ms", type=float, default=d.embedded_ttft_ms,
                       help="simulated workers' time to first token in ms (default %(default)s)")
    serve.add_argument("--embedded-itl-ms", type=float, default=d.embedded_itl_ms,
                       help="simulated workers' inter-token latency in ms (default %(default)s)")
    serve.add_argument("--skip-broken-codecs", action=argparse.BooleanOptionalAction, default=d.skip_broken_codecs,
                       help="start even if an installed codec fails to load (it is logged and skipped)")
    serve.add_argument("--trace-file", default=d.trace_file, metavar="PATH",
                       help="write one JSONL request-end record per request to files named "
                            "PATH.<pid>.<start>.<n>.jsonl (PATH less any .jsonl suffix) in an existing "
                            "folder; tracing is off "
                            "unless this or --trace-stderr is given")
    serve.add_argument("--trace-stderr", action=argparse.BooleanOptionalAction, default=d.trace_stderr,
                       help="write the trace records to stderr too")
    serve.add_argument("--trace-queue-size", type=int, default=d.trace_queue_size,
                       help="records that may wait for the trace writer; more are dropped and counted "
                            "(default %(default)s)")
    serve.add_argument("--trace-rotate-bytes", type=int, default=d.trace_rotate_bytes,
                       help="start a new trace file past this many bytes; 0 = never (default %(default)s)")
    serve.add_argument("--trace-block-size", type=int, default=d.trace_block_size,
                       help="tokens per replay block hash in trace records (default %(default)s)")
    serve.add_argument("--tokenizer", default=d.tokenizer, metavar="PATH",
                       help="a Hugging Face tokenizer.json, loaded at start; only the trace output "
                            "parsers below use it (to find their marker tokens), so it needs one of them")
    serve.add_argument("--reasoning-parser", default=d.reasoning_parser, metavar="NAME",
                       help="count reasoning tokens in traces: qwen3, deepseek_r1 or an installed parser")
    serve.add_argument("--tool-call-parser", default=d.tool_call_parser, metavar="NAME",
                       help="record tool-call names and the tool_calls finish reason in traces: hermes or "
                            "an installed parser")
    serve.add_argument("--otlp-endpoint", default=d.otlp_endpoint, metavar="URL",
                       help="OTLP/HTTP collector (http://HOST:4318): a span per request, a child span per "
                            "engine leg, a traceparent to each engine; the OTEL_* variables apply")
    serve.add_argument("--trace-otlp", action=argparse.BooleanOptionalAction, default=d.trace_otlp,
                       help="also export the request-end records to --otlp-endpoint as OTLP log records")
    serve.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS, default="info",
                       help="logging level (default %(default)s)")

    sim = sub.add_parser("sim", help="run a simulated engine worker", formatter_class=_Help)
    sim.add_argument("--protocol", choices=("sglang", "vllm"), default="sglang", help="native protocol to speak")
    sim.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    sim.add_argument("--port", type=PORT, default=30000, help="port to listen on (default %(default)s)")
    sim.add_argument("--fd", type=_bounded(int, 0), default=None, help="serve an inherited listening socket instead")
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
    sim.add_argument("--enable-return-routed-experts", action="store_true",
                     help="vLLM: answer each finished choice's routed_experts (base64 .npy rows), as vLLM "
                          "--enable-return-routed-experts does (SGLang requests ask return_routed_experts)")
    sim.add_argument("--disconnect-abort-s", type=_bounded(float, 0), default=2.0, metavar="S",
                     help="SGLang: seconds after a client vanished before the engine aborts its request "
                          "itself, as SGLang's background abort does (default %(default)s)")
    sim.add_argument("--cache-tokens", type=_bounded(int, 0), default=0, metavar="N",
                     help="prefix cache capacity in tokens, LRU (SGLang radix cache, vLLM prefix caching in "
                          "16-token blocks); 0 = no cache (default %(default)s)")
    sim.add_argument("--prefill-us-per-token", type=_bounded(float, 0), default=0.0, metavar="US",
                     help="prefill compute per uncached prompt token in microseconds, one prefill after "
                          "another, added to --ttft-ms (default %(default)s)")
    sim.add_argument("--enable-prompt-tokens-details", action="store_true",
                     help="vLLM: report usage.prompt_tokens_details.cached_tokens (vLLM's server flag)")
    sim.add_argument("--model-name", default="sim", help="served model name (default %(default)s)")
    sim.add_argument("--parent-pid", type=_bounded(int, 1), default=None, help="exit when this process exits")
    sim.add_argument("--worker-class", choices=WORKER_CLASSES, default="asyncio",
                     help="hypercorn worker class (default %(default)s)")
    sim.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS, default="warning",
                     help="logging level (default %(default)s)")

    sub.add_parser("codecs", help="list the installed codecs")
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
    return Settings(
        workers=args.worker if args.worker is not None else d.workers,
        prefill=args.prefill if args.prefill is not None else d.prefill,
        decode=args.decode if args.decode is not None else d.decode,
        disaggregation=args.disaggregation,
        pd_fallback=args.pd_fallback,
        policy=args.policy,
        session_headers=args.session_headers,
        session_balance_epsilon=args.session_balance_epsilon,
        cache_threshold=args.cache_threshold,
        balance_abs_threshold=args.balance_abs_threshold,
        balance_rel_threshold=args.balance_rel_threshold,
        max_tree_tokens=args.max_tree_tokens,
        max_tree_nodes=args.max_tree_nodes,
        workers_file=args.workers_file,
        discovery_interval=args.discovery_interval,
        worker_ca_file=args.worker_ca_file,
        worker_insecure=args.worker_insecure,
        max_body_bytes=args.max_body_bytes,
        body_budget_bytes=args.body_budget_bytes,
        body_budget_wait=args.body_budget_wait,
        body_read_timeout=args.body_read_timeout,
        connect_timeout=args.connect_timeout,
        headers_timeout=args.headers_timeout,
        first_token_timeout=args.first_token_timeout,
        inter_token_timeout=args.inter_token_timeout,
        request_timeout=args.request_timeout,
        migration_limit=args.migration_limit,
        health_interval=args.health_interval,
        health_timeout=args.health_timeout,
        health_failures=args.health_failures,
        sse_keepalive=args.sse_keepalive,
        abort_timeout=args.abort_timeout,
        abort_concurrency=args.abort_concurrency,
        abort_queue_size=args.abort_queue_size,
        abort_batch=args.abort_batch,
        abort_deadline=args.abort_deadline,
        admin_token=args.admin_token,
        admin_timeout=args.admin_timeout,
        slow_client_timeout=args.slow_client_timeout,
        shutdown_grace=args.shutdown_grace,
        embedded_workers=args.embedded_workers,
        embedded_ttft_ms=args.embedded_ttft_ms,
        embedded_itl_ms=args.embedded_itl_ms,
        embedded_pd=args.embedded_pd,
        split_batches=args.split_batches,
        skip_broken_codecs=args.skip_broken_codecs,
        trace_file=args.trace_file,
        trace_stderr=args.trace_stderr,
        trace_queue_size=args.trace_queue_size,
        trace_rotate_bytes=args.trace_rotate_bytes,
        trace_block_size=args.trace_block_size,
        tokenizer=args.tokenizer,
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        otlp_endpoint=args.otlp_endpoint,
        trace_otlp=args.trace_otlp,
    )


def _fail(message: str) -> int:
    print(f"asgi-generate: {message}", file=sys.stderr)
    return 2


def _serve(args: argparse.Namespace, d: Settings) -> int:
    from .app import App
    from ..ops.metrics import MetricsSetupError, multiproc_dir
    from ..sdk.registry import CodecLoadError, load_codecs
    from .serving import listening_socket
    from .supervisor import supervise
    from ..tracing import Tracer, TraceSetupError

    hold_signals()  # a Ctrl-C while starting up stops cleanly once serving begins
    settings = _settings(args, d)
    # Whatever can be refused is refused here, as one line, before the
    # codecs load, a simulator starts or hypercorn runs.
    try:
        settings.check()
        if args.workers == 1:  # N processes get a folder of serve's own
            multiproc_dir()
        tls = _server_tls(args)
    except ValueError as exc:
        return _fail(str(exc))
    try:
        sock = socket.socket(fileno=args.fd) if args.fd is not None else listening_socket(args.host, args.port)
    except OSError as exc:
        where = f"fd {args.fd}" if args.fd is not None else f"{args.host}:{args.port}"
        return _fail(f"cannot listen on {where}: {exc.strerror or exc}")
    pid_file = pathlib.Path(args.pid_file) if args.pid_file else None
    try:
        try:
            codecs = load_codecs(settings.skip_broken_codecs, protocols=PROTOCOLS)
            if args.workers == 1:
                app = App(settings, codecs)
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
        if args.workers > 1:
            protocols = {item.codec.worker_protocol for item in codecs}
            return supervise(settings, sock, args.workers, args.worker_class, args.shutdown_grace, protocols,
                             log_level=args.log_level, access_log=args.access_log, tls=tls)
        # hypercorn's own deadline only backs up the app's: grace, then
        # aborts. hypercorn serves (and closes) the descriptor itself.
        config = hypercorn_config(fd=sock.detach(), graceful_timeout=settings.shutdown_grace + 15.0,
                                  log_level=args.log_level, access_log=args.access_log, tls=tls)
        run(app, config, args.worker_class)
        return 0
    finally:
        sock.close()  # a no-op once detached
        if pid_file is not None:
            pid_file.unlink(missing_ok=True)


def _where(sock: socket.socket, tls: ServerTLS | None = None) -> str:
    host, port = sock.getsockname()[:2]
    scheme = "https" if tls is not None else "http"
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def _sim(args: argparse.Namespace) -> int:
    # asyncio warns on every write to a client that hung up; a simulator
    # serving abandoned streams would flood the log with them.
    logging.getLogger("asyncio").setLevel(logging.ERROR)

    try:
        app = _sim_app(args)
        tls = _server_tls(args)
    except ValueError as exc:
        print(f"asgi-generate sim: {exc}", file=sys.stderr)
        return 2
    config = hypercorn_config(host=args.host, port=args.port, fd=args.fd, graceful_timeout=1.0,
                              log_level=args.log_level, access_log=False, tls=tls)
    run(app, config, args.worker_class)
    return 0


def _sim_app(args: argparse.Namespace) -> "SimApp":
    """The simulator app the ``sim`` flags describe.

    Raises:
        ValueError: a flag value the simulator cannot play.
    """
    from ..sim.app import SimApp

    return SimApp(
        protocol=args.protocol,
        ttft_ms=args.ttft_ms,
        itl_ms=args.itl_ms,
        incremental_streaming_output=args.incremental_streaming_output,
        model_name=args.model_name,
        parent_pid=args.parent_pid,
        usage_chunk=not args.no_usage_chunk,
        engine_version=args.engine_version,
        stream_interval=args.stream_interval,
        emit_markers=args.emit_markers,
        abort_after=args.abort_after,
        abort_status=args.abort_status,
        disaggregation_mode=args.disaggregation_mode,
        bootstrap_port=args.bootstrap_port,
        disaggregation_timeout_s=args.disaggregation_timeout_s,
        kv_role=args.kv_role,
        kv_expiry_s=args.kv_expiry_s,
        disconnect_abort_s=args.disconnect_abort_s,
        routed_experts=args.enable_return_routed_experts,
        cache_tokens=args.cache_tokens,
        prefill_us_per_token=args.prefill_us_per_token,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
    )


def _report_problems(lines: list[str]) -> None:
    for line in lines:
        print(f"asgi-generate: {line}", file=sys.stderr)


def _codecs() -> int:
    """List every codec that loads; name each that does not, and each
    collision, on stderr and exit 2 (``serve`` would refuse to start)."""
    from ..sdk.registry import discover

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


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``asgi-generate`` console script."""
    argv = sys.argv[1:] if argv is None else argv
    d = Settings()
    if argv[:1] == ["serve"]:
        try:  # the variables are serve's defaults, exactly as under hypercorn
            d = Settings.from_env()
        except ValueError as exc:
            return _fail(str(exc))
    args = build_parser(d).parse_args(argv)
    if args.command == "codecs":
        return _codecs()
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.command == "serve":
        return _serve(args, d)
    return _sim(args)
