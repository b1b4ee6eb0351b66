"""Frontend settings, from command-line flags or environment variables.

Every setting has a flag (``asgi-generate serve --help``) and an environment
variable ``ASGI_GENERATE_<NAME>``, so ``hypercorn asgi_generate.server.asgi:app``
serves the same app as ``asgi-generate serve`` (whose flags override the
variables). :meth:`Settings.check` is what both run before anything starts.
"""

from __future__ import annotations

import math
import os
import pathlib
import ssl
from dataclasses import dataclass, field, fields
from typing import Mapping
from urllib.parse import urlsplit

from .request.budget import default_budget_bytes
from .workers.policies import POLICIES
from .workers.policies.session import DEFAULT_HEADERS
from .workers.discovery import read_workers_file
from .workers.router import DISAGGREGATION_MODES, parse_worker_spec

ENV_PREFIX = "ASGI_GENERATE_"
#: Numeric settings that must be above zero (every other one: zero or more).
POSITIVE = frozenset({
    "max_body_bytes", "body_budget_bytes", "body_read_timeout", "connect_timeout", "health_interval",
    "health_timeout", "health_failures", "abort_timeout", "admin_timeout",
    "abort_concurrency", "abort_queue_size", "abort_batch", "abort_deadline",
    "slow_client_timeout", "embedded_workers", "trace_queue_size", "trace_block_size", "discovery_interval",
    "max_tree_tokens", "max_tree_nodes",
})
#: Old variable names still read, and the setting each now sets.
ENV_ALIASES = {"READ_TIMEOUT": "inter_token_timeout"}
#: Worker list settings and the role of their workers.
WORKER_LISTS = {"workers": "aggregated", "prefill": "prefill", "decode": "decode"}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def flag_name(name: str) -> str:
    """The ``serve`` flag of the setting ``name``: ``--max-body-bytes``."""
    return "--" + name.replace("_", "-")


def env_name(name: str) -> str:
    """The variable of the setting ``name``: ``ASGI_GENERATE_MAX_BODY_BYTES``."""
    return ENV_PREFIX + name.upper()


@dataclass(slots=True)
class Settings:
    """The frontend's configuration.

    Attributes:
        workers: ``(protocol, url)`` pairs of aggregated workers; with no
            worker of any role, embedded simulators start.
        prefill, decode: ``(protocol, url)`` pairs of prefill and decode
            workers (P/D); an SGLang prefill URL may end ``?bootstrap_port=B``
            (default 8998).
        disaggregation: ``auto`` (P/D pairs when the protocol has both
            roles up, else aggregated), ``always`` or ``never``.
        pd_fallback: a vLLM prefill leg that answered no
            ``kv_transfer_params`` lets the decode leg prefill alone
            (recorded as the decode attempt's ``local_prefill``) instead of
            failing the request.
        workers_file: a JSON or TOML file listing more workers
            (:func:`asgi_generate.workers.discovery.read_workers_file`),
            reread when it changes; ``None``: none.
        discovery_interval: seconds between reads of the fleet's members
            (``dns://`` names resolved, the workers file checked for changes).
        worker_ca_file: PEM CA bundle ``https://`` workers' certificates are
            verified against (only it is trusted); ``None``: the system's CAs.
        worker_insecure: do not verify ``https://`` workers' certificates
            (testing only; logged as a warning).
        max_body_bytes: request body cap; larger bodies get 413.
        body_budget_bytes: request body bytes that may be read and decoded
            at once, over all requests (a chunked body counts as
            ``max_body_bytes``); default: 1/128 of physical memory clamped to
            [64 MiB, 512 MiB] (:func:`asgi_generate.request.budget.default_budget_bytes`).
        body_budget_wait: seconds a request may wait for room in that budget
            before it gets 503 with ``Retry-After``, its body unread.
        body_read_timeout: seconds a client has to send its whole body once
            its turn came; a stalled upload gets 408 and is closed.
        connect_timeout: seconds to connect to a worker.
        headers_timeout: seconds from sending a streamed engine leg to its
            response headers (engines send them at once, before any token).
        first_token_timeout: seconds from a streamed leg's headers to its
            first SSE event (queueing plus prefill).
        inter_token_timeout: seconds a streamed leg may go without an SSE
            event; comments and keep-alive bytes do not count.
        request_timeout: seconds a unary engine leg (silent until its answer
            is whole) may take in all. A phase timeout of 0 means none; a
            leg past one is aborted and its request ended (504, or in-band
            after the 200), the worker stays up, the prompt goes nowhere else.
        migration_limit: resumed attempts a streamed request may make after
            its first when workers die mid-answer (0: no migration).
        health_interval: seconds between the end of one health probe of a
            worker and the next (every worker, up or down).
        health_timeout: seconds one health probe may take.
        health_failures: failed probes in a row that take an up worker out
            of the rotation and end its in-flight requests.
        sse_keepalive: seconds of silence before an SSE keep-alive comment
            (0 disables them).
        abort_timeout: seconds an engine has to accept and answer an abort
            request; an unanswered one is unacknowledged, never re-sent (a
            non-200 answer is retried: three tries, with backoff).
        abort_concurrency: abort requests in flight at once per worker, each
            on its own kept-alive connection apart from generate and probe
            connections (see :mod:`asgi_generate.workers.aborts`).
        abort_queue_size: aborts that may wait per worker; more are refused
            and counted unacknowledged.
        abort_batch: engine ids per abort request where the engine's route
            takes a list (vLLM ``/abort_requests``).
        abort_deadline: seconds a request's end waits, at most, for its
            aborts' answers, queueing included.
        admin_token: when set, admin routes (``/flush_cache``,
            ``/pause_generation``, ...: :mod:`asgi_generate.ops.admin`) need
            ``Authorization: Bearer <admin_token>``; ``None``: open.
        admin_timeout: seconds an admin route's fan-out waits for each
            worker's answer.
        slow_client_timeout: seconds a client may leave one write untaken
            before it is cut off (``slow_client``) and the engine aborted.
        shutdown_grace: seconds in-flight requests get to finish after
            SIGTERM/SIGINT before they are aborted and ended cleanly.
        embedded_workers: simulators started per protocol when no worker is given.
        embedded_pd: with the embedded simulators, also one prefill and one
            decode simulator per protocol (P/D pairs).
        split_batches: spread a batch's prompts over the healthy workers
            (one engine request per worker) instead of sending the whole
            batch to one worker as one engine request.
        embedded_ttft_ms, embedded_itl_ms: their time to first token and
            inter-token latency.
        skip_broken_codecs: start even if an installed codec fails to load.
        trace_file: write request-end records as JSONL to files named from
            this path (see :class:`asgi_generate.tracing.sinks.JsonlFileSink`);
            ``None`` and ``trace_stderr`` off disable tracing.
        trace_stderr: also write the records to standard error.
        trace_queue_size: records that may wait for the trace writer; more
            are dropped and counted.
        trace_rotate_bytes: start a new trace file past this size (0: never).
        trace_block_size: tokens per replay block hash.
        tokenizer: the model's Hugging Face ``tokenizer.json``: a migrated
            stream's text prompt is tokenized with it and its stop strings
            checked across the seam; the trace parsers below decode output
            with it.
        reasoning_parser, tool_call_parser: output parsers for the trace
            (``qwen3``/``deepseek_r1``, ``hermes``, or installed ones).
        otlp_endpoint: an OTLP/HTTP collector's base URL
            (``http://collector:4318``): each request becomes a span with a
            child per engine leg, and engines get a ``traceparent``
            (:mod:`asgi_generate.tracing.otlp`); ``None``: off.
        trace_otlp: also export the request-end records to that collector
            as OTLP log records.
        policy: the routing policy, ``least-outstanding``, ``session`` or
            ``cache-aware`` (:mod:`asgi_generate.workers.policies`).
        session_headers: ``session``: comma-separated headers the session
            key is read from, the first present wins.
        session_balance_epsilon: ``session``: a worker takes keyed requests
            while below ``ceil((1 + epsilon) * (outstanding + 1) / workers)``.
        cache_threshold: ``cache-aware``: share of the prompt the longest
            match must exceed to route by it (0 to 1).
        balance_abs_threshold, balance_rel_threshold: ``cache-aware``: load
            is imbalanced (least outstanding wins) when the most and fewest
            outstanding requests differ by more than the first and the most
            exceeds the second times the fewest.
        max_tree_tokens, max_tree_nodes: ``cache-aware``: each worker's
            prefix tree bounds, least recently used leaves evicted past them.
    """

    workers: list[tuple[str, str]] = field(default_factory=list)
    max_body_bytes: int = 32 * 1024 * 1024
    body_budget_bytes: int = field(default_factory=default_budget_bytes)
    body_budget_wait: float = 120.0
    body_read_timeout: float = 30.0
    connect_timeout: float = 5.0
    headers_timeout: float = 60.0
    first_token_timeout: float = 1800.0
    inter_token_timeout: float = 300.0
    request_timeout: float = 0.0
    migration_limit: int = 3
    health_interval: float = 2.0
    health_timeout: float = 30.0
    health_failures: int = 3
    sse_keepalive: float = 15.0
    abort_timeout: float = 10.0
    abort_concurrency: int = 8
    abort_queue_size: int = 16384
    abort_batch: int = 512
    abort_deadline: float = 30.0
    admin_token: str | None = None
    admin_timeout: float = 60.0
    slow_client_timeout: float = 30.0
    shutdown_grace: float = 30.0
    embedded_workers: int = 2
    embedded_ttft_ms: float = 0.0
    embedded_itl_ms: float = 0.0
    skip_broken_codecs: bool = False
    trace_file: str | None = None
    trace_stderr: bool = False
    trace_queue_size: int = 4096
    trace_rotate_bytes: int = 256 * 1024 * 1024
    trace_block_size: int = 64
    tokenizer: str | None = None
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    prefill: list[tuple[str, str]] = field(default_factory=list)
    decode: list[tuple[str, str]] = field(default_factory=list)
    disaggregation: str = "auto"
    pd_fallback: bool = False
    embedded_pd: bool = False
    otlp_endpoint: str | None = None
    trace_otlp: bool = False
    split_batches: bool = False
    policy: str = "least-outstanding"
    session_headers: str = DEFAULT_HEADERS
    session_balance_epsilon: float = 1.0
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    max_tree_tokens: int = 1 << 20
    max_tree_nodes: int = 1 << 16
    workers_file: str | None = None
    discovery_interval: float = 5.0
    worker_ca_file: str | None = None
    worker_insecure: bool = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "Settings":
        """Settings from ``ASGI_GENERATE_*`` variables; unset or empty ones
        keep their defaults. ``ASGI_GENERATE_WORKERS`` (``..._PREFILL``,
        ``..._DECODE``) is a comma-separated list of
        ``PROTOCOL=http://HOST:PORT`` (or ``dns://NAME:PORT``); booleans are ``1/0``,
        ``true/false``, ``yes/no`` or ``on/off``. ``ASGI_GENERATE_READ_TIMEOUT``
        (the old name) sets ``inter_token_timeout`` unless that is set too.

        Raises:
            ValueError: a variable does not parse, or an ``ASGI_GENERATE_*``
                variable names no setting (a typo would otherwise be ignored).
        """
        known = {env_name(f.name): f for f in fields(cls)}
        old_names = {ENV_PREFIX + old for old in ENV_ALIASES}
        unknown = sorted(k for k in environ if k.startswith(ENV_PREFIX) and k not in known and k not in old_names)
        if unknown:
            raise ValueError(f"unknown variable {unknown[0]} (known: {', '.join(known)})")
        values: dict = {}
        # Old names first, so that the new name wins when both are set.
        for var, f in [*((ENV_PREFIX + old, known[env_name(new)]) for old, new in ENV_ALIASES.items()),
                       *known.items()]:
            raw = environ.get(var)
            if raw is None or raw == "":
                continue
            if f.name in WORKER_LISTS:
                role = WORKER_LISTS[f.name]
                try:
                    values[f.name] = [parse_worker_spec(s.strip(), role) for s in raw.split(",") if s.strip()]
                except ValueError as exc:
                    raise ValueError(f"{var}: {exc}") from None
            elif f.type == "bool":
                if raw.lower() not in _TRUE + _FALSE:
                    raise ValueError(f"{var}={raw!r} is not a boolean (1/0, true/false, yes/no, on/off)")
                values[f.name] = raw.lower() in _TRUE
            elif f.type in ("str | None", "str"):
                values[f.name] = raw
            else:
                try:
                    values[f.name] = (int if f.type == "int" else float)(raw)
                except ValueError:
                    raise ValueError(f"{var}={raw!r} is not a number") from None
        return cls(**values)

    def check(self) -> None:
        """Refuse settings the server cannot run with, before anything starts.

        Every number must be zero or more (and not NaN), and above zero for
        :data:`POSITIVE` ones. ``trace_file`` must name a file in an existing
        folder (the folder is not created: a typo should not scatter trace
        files). ``tokenizer``, when given, must load.

        Raises:
            ValueError: one line naming the flag and variable at fault.
        """
        if self.disaggregation not in DISAGGREGATION_MODES:
            raise ValueError(f"--disaggregation ({env_name('disaggregation')}) must be one of "
                             f"{', '.join(DISAGGREGATION_MODES)}, not {self.disaggregation!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"--policy ({env_name('policy')}) must be one of {', '.join(POLICIES)}, "
                             f"not {self.policy!r}")
        if not any(h.strip() for h in self.session_headers.split(",")):
            raise ValueError(f"--session-headers ({env_name('session_headers')}) names no header")
        if not self.cache_threshold <= 1:
            raise ValueError(f"--cache-threshold ({env_name('cache_threshold')}) must be between 0 and 1, "
                             f"not {self.cache_threshold!r}")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type not in ("int", "float"):
                continue
            least = "above 0" if f.name in POSITIVE else "0 or more"
            if math.isnan(value) or value < 0 or (value == 0 and f.name in POSITIVE):
                raise ValueError(f"{flag_name(f.name)} ({env_name(f.name)}) must be {least}, not {value!r}")
        if self.workers_file is not None:
            try:
                read_workers_file(self.workers_file)
            except ValueError as exc:
                raise ValueError(f"--workers-file ({env_name('workers_file')}): {exc}") from None
        if self.worker_ca_file is not None:
            try:
                ssl.create_default_context(cafile=self.worker_ca_file)
            except (OSError, ssl.SSLError) as exc:
                why = getattr(exc, "reason", None) or exc.strerror or exc
                raise ValueError(f"--worker-ca-file ({env_name('worker_ca_file')}): cannot load "
                                 f"{self.worker_ca_file!r}: {why}") from None
        if self.trace_file is not None:
            folder = pathlib.Path(self.trace_file).expanduser().absolute().parent
            if not folder.is_dir():
                raise ValueError(f"--trace-file ({env_name('trace_file')}): folder {str(folder)!r} does not exist")
        if self.tokenizer is not None:
            from tokenizers import Tokenizer

            try:
                Tokenizer.from_file(self.tokenizer)
            except Exception as exc:  # tokenizers raises a bare Exception
                first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise ValueError(f"--tokenizer: cannot load {self.tokenizer!r}: {first}") from None
        if (self.reasoning_parser or self.tool_call_parser) and not (
                self.trace_file or self.trace_stderr or self.otlp_endpoint):
            raise ValueError("--reasoning-parser and --tool-call-parser only annotate trace records: "
                             "give --trace-file, --trace-stderr or --otlp-endpoint")
        if self.otlp_endpoint is not None:
            parts = urlsplit(self.otlp_endpoint)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"--otlp-endpoint ({env_name('otlp_endpoint')}) must be an http(s)://HOST[:PORT] "
                                 f"URL, not {self.otlp_endpoint!r}")
        if self.trace_otlp and not self.otlp_endpoint:
            raise ValueError("--trace-otlp exports records to the --otlp-endpoint collector: give one")

    def to_env(self) -> dict[str, str]:
        """The environment variables that reproduce these settings."""
        env = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if f.name in WORKER_LISTS:
                value = ",".join(f"{p}={u}" for p, u in value)
            elif isinstance(value, bool):
                value = "1" if value else "0"
            env[env_name(f.name)] = str(value)
        return env
