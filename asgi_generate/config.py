"""Frontend settings, from command-line flags or environment variables.

Each setting is declared once, as a field of :class:`Settings` made by
:func:`setting`: its type (the annotation), default, unit, bounds or choices,
help text, and how its flag and variable are spelled. From that declaration
come the ``serve`` flags and their ``--help``
(:func:`asgi_generate.server.cli.build_parser`), the variables
``ASGI_GENERATE_<NAME>`` (:meth:`Settings.from_env`, :meth:`Settings.to_env`),
the bounds :meth:`Settings.check` enforces and the configuration reference's
settings table, docs/configuration.md
(:func:`settings_table`). So ``hypercorn asgi_generate.server.asgi:app``
serves the same app as ``asgi-generate serve`` (whose flags override the
variables); :meth:`Settings.check` is what both run before anything starts.
"""

from __future__ import annotations

import difflib
import os
import pathlib
import ssl
from dataclasses import MISSING, dataclass, field, fields, replace
from functools import partial
from typing import Any, Callable, Mapping, get_type_hints
from urllib.parse import urlsplit

from .sdk import MAX_REQUEST_ITEMS
from .worker_specs import kv_source_text, parse_kv_source, parse_worker_spec, read_workers_file

ENV_PREFIX = "ASGI_GENERATE_"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
#: ``--disaggregation``: when a request runs as a P/D pair.
DISAGGREGATION_MODES = ("auto", "always", "never")
#: ``--policy``: the routing policies (:mod:`asgi_generate.workers.policies`).
POLICIES = ("least-outstanding", "session", "cache-aware", "kv-aware")
#: ``--session-headers``' default: the headers a session key is read from.
DEFAULT_SESSION_HEADERS = "x-session-id,x-smg-routing-key"


def default_budget_bytes() -> int:
    """``--body-budget-bytes``' default: 1/128 of physical memory, clamped
    to [64 MiB, 512 MiB].

    Decoded, the bytes in the budget take up to ~9x their size (raw body plus
    Python objects), so at most ~7% of the machine's memory goes to bodies in
    flight: 184 MiB on a 23 GiB machine, about 1.6 GiB decoded at worst.
    """
    mib = 1024 * 1024
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8192 * mib
    return max(64 * mib, min(512 * mib, total // 128))


def parse_weights(text: str) -> dict[str, float]:
    """``--admission-tenant-weights`` (``a=2,b=1``) as a dict.

    Raises:
        ValueError: an item without ``=`` or a weight that is not a positive number.
    """
    weights = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = 0.0
        if not sep or not name.strip() or not weight > 0:
            raise ValueError(f"{item!r} is not TENANT=WEIGHT with a positive weight")
        weights[name.strip()] = weight
    return weights


def parse_priorities(text: str, classes: list[str]) -> dict[str, int]:
    """``--admission-engine-priority`` (``eval=-10,bulk=10``) as a dict.

    Raises:
        ValueError: an item that is not CLASS=INTEGER with a known class.
    """
    priorities = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        name = name.strip()
        try:
            priority = int(value)
        except ValueError:
            sep = ""
        if not sep or name not in classes:
            raise ValueError(f"{item!r} is not CLASS=INTEGER with a class of {', '.join(classes)}")
        priorities[name] = priority
    return priorities


@dataclass(frozen=True, slots=True)
class Setting:
    """One setting's declaration: what its :class:`Settings` field holds in
    its metadata, completed with the field's name and type in :data:`SETTINGS`.

    Attributes:
        help: what it does, for ``serve --help`` and the settings table,
            which add the default.
        unit: a number's unit (``s``, ``ms``, ``bytes``, ``tokens``); ``""``
            for a count or a number without one.
        gt, ge, le: a number's bounds: above ``gt``, at least ``ge`` (0
            unless declared), at most ``le``; NaN is refused.
        choices: the values a string may take.
        flag: its flag, when not ``--`` and the name with dashes.
        old_names: names it had before, still read as flags and variables
            (``read_timeout``: ``--read-timeout``, ``ASGI_GENERATE_READ_TIMEOUT``).
        metavar: the flag's value in ``--help`` (default: the name in capitals).
        item: a list's element from its text (raises ValueError); the flag
            repeats, the variable is a comma-separated list.
        item_text: the text of a list's element, the inverse of ``item``.
        default_text: the default, said in words, where it is computed at
            start (``--help`` shows this machine's value beside it).
        name, kind: the field's name and type.
    """

    help: str
    unit: str = ""
    gt: float | None = None
    ge: float | None = 0
    le: float | None = None
    choices: tuple[str, ...] = ()
    flag: str | None = None
    old_names: tuple[str, ...] = ()
    metavar: str | None = None
    item: Callable[[str], Any] | None = None
    item_text: Callable[[Any], str] = str
    default_text: str = ""
    name: str = ""
    kind: Any = None

    @property
    def flags(self) -> tuple[str, ...]:
        """Its flag, then its old names': ``("--inter-token-timeout", "--read-timeout")``."""
        return (self.flag or _flag(self.name), *map(_flag, self.old_names))

    @property
    def env(self) -> str:
        """Its variable: ``ASGI_GENERATE_MAX_BODY_BYTES``."""
        return ENV_PREFIX + self.name.upper()

    @property
    def old_envs(self) -> tuple[str, ...]:
        """The variables of its old names: ``("ASGI_GENERATE_READ_TIMEOUT",)``."""
        return tuple(ENV_PREFIX + old.upper() for old in self.old_names)

    @property
    def label(self) -> str:
        """How an error names it: ``--max-body-bytes (ASGI_GENERATE_MAX_BODY_BYTES)``."""
        return f"{self.flags[0]} ({self.env})"

    def parse(self, text: str, var: str) -> Any:
        """The value of ``text``, read from the variable ``var``.

        Raises:
            ValueError: naming ``var``: not a number, not a boolean
                (``1/0``, ``true/false``, ``yes/no``, ``on/off``), or a list
                element ``item`` refuses.
        """
        if self.item is not None:
            try:
                return [self.item(part.strip()) for part in text.split(",") if part.strip()]
            except ValueError as exc:
                raise ValueError(f"{var}: {exc}") from None
        if self.kind is bool:
            if text.lower() not in _TRUE + _FALSE:
                raise ValueError(f"{var}={text!r} is not a boolean (1/0, true/false, yes/no, on/off)")
            return text.lower() in _TRUE
        if self.kind in (int, float):
            try:
                return self.kind(text)
            except ValueError:
                raise ValueError(f"{var}={text!r} is not a number") from None
        return text

    def text(self, value: Any) -> str:
        """``value`` as its variable's text, which :meth:`parse` reads back."""
        if self.item is not None:
            return ",".join(map(self.item_text, value))
        if isinstance(value, bool):
            return "1" if value else "0"
        return str(value)

    def shown(self, value: Any) -> str:
        """``value`` as help shows it: ``none``, ``on``/``off`` or its text."""
        if value is None or value == []:
            return "none"
        if isinstance(value, bool):
            return "on" if value else "off"
        return self.text(value)

    def fault(self, value: Any) -> str | None:
        """What is wrong with ``value`` (``must be above 0, not -5``), or
        ``None``: a choice not among :attr:`choices`, a number out of bounds."""
        if self.choices and value not in self.choices:
            return f"must be one of {', '.join(self.choices)}, not {value!r}"
        if self.kind not in (int, float):
            return None
        if self.le is not None and not value <= self.le:
            return f"must be between {self.ge} and {self.le}, not {value!r}"
        if self.gt is not None and not value > self.gt:
            return f"must be above {self.gt}, not {value!r}"
        if self.ge is not None and not value >= self.ge:
            return f"must be {self.ge} or more, not {value!r}"
        return None


def setting(default: Any = MISSING, *, factory: Callable[[], Any] | None = None, **declaration: Any) -> Any:
    """A :class:`Settings` field: its ``default`` (or ``factory`` computing
    one) and its :class:`Setting` made of ``declaration``."""
    metadata = {"setting": Setting(**declaration)}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _worker_text(spec: tuple[str, str]) -> str:
    protocol, url = spec
    return f"{protocol}={url}"


def _workers(role: str, **declaration: Any) -> Any:
    """A list of ``(protocol, url)`` workers in ``role``
    (:func:`asgi_generate.worker_specs.parse_worker_spec`)."""
    return setting(factory=list, item=partial(parse_worker_spec, role=role), item_text=_worker_text,
                   metavar="PROTOCOL=URL", **declaration)


@dataclass(slots=True)
class Settings:
    """The frontend's configuration: one attribute per setting, each
    declared below with its unit, bounds and help (``serve --help`` and the
    configuration reference, docs/configuration.md, show the same).

    Worker lists hold ``(protocol, url)`` pairs; with no worker of any role,
    embedded simulators start. A phase timeout of 0 means none; a leg past
    one is aborted and its request ended (504, or in-band after the 200),
    the worker stays up, the prompt goes nowhere else. ``None`` is unset.
    """

    workers: list[tuple[str, str]] = _workers(
        "aggregated", flag="--worker",
        help="an engine worker, PROTOCOL sglang or vllm, e.g. sglang=http://127.0.0.1:30000, or "
             "sglang=dns://NAME:PORT for every address NAME resolves to (repeat for more); with none, "
             "simulated workers are started")
    max_body_bytes: int = setting(
        32 * 1024 * 1024, unit="bytes", gt=0, help="request body cap in bytes; larger bodies get 413")
    body_budget_bytes: int = setting(
        factory=default_budget_bytes, unit="bytes", gt=0,
        default_text="1/128 of physical memory within [64 MiB, 512 MiB]",
        help="request body bytes read and decoded at once over all requests (a chunked body counts as "
             "--max-body-bytes); more wait, then get 503 with Retry-After")
    body_budget_wait: float = setting(
        120.0, unit="s", help="seconds a request may wait for room in the body budget before its 503")
    header_read_timeout: float = setting(
        10.0, unit="s", gt=0,
        help="seconds a client has to send a request's head (request line and headers), from accept for a "
             "connection's first request, else from the head's first byte (until then an idle keep-alive "
             "connection waits for it up to the keep-alive timeout, 75 s under serve); past it the connection "
             "is closed, with a 408 if part of the head came")
    body_read_timeout: float = setting(
        30.0, unit="s", gt=0, help="seconds a client has to send its whole body; a stalled upload gets 408")
    slow_client_timeout: float = setting(
        30.0, unit="s", gt=0,
        help="seconds a client may leave a write untaken before it is cut off and the engine aborted")
    max_request_items: int = setting(
        MAX_REQUEST_ITEMS, gt=0, metavar="N",
        help="items one request may carry (an SGLang batch's prompts times n, a vLLM request's n); more get "
             "the format's 400 before any engine sees them")
    prefill: list[tuple[str, str]] = _workers(
        "prefill",
        help="a P/D prefill worker, e.g. sglang=http://127.0.0.1:30000?bootstrap_port=8998 "
             "(bootstrap port default 8998; repeat for more)")
    decode: list[tuple[str, str]] = _workers(
        "decode", help="a P/D decode worker, e.g. sglang=http://127.0.0.1:30001 (repeat for more)")
    disaggregation: str = setting(
        "auto", choices=DISAGGREGATION_MODES,
        help="auto: a request runs as a prefill/decode pair when its protocol has both up, else on an "
             "aggregated worker; always: pairs only; never: aggregated only")
    pd_fallback: bool = setting(
        False,
        help="vLLM P/D: when the prefill worker answers no kv_transfer_params (it stopped before its "
             "one-token cap), let the decode worker prefill alone (recorded as local_prefill) instead of "
             "failing the request")
    split_batches: bool = setting(
        False,
        help="spread a batch's prompts over the workers instead of sending it to one worker as one engine "
             "request")
    workers_file: str | None = setting(
        None, metavar="PATH",
        help="a JSON (or .toml) file with lists workers, prefill and decode of PROTOCOL=URL specs, reread "
             "when it changes; workers that leave it drain")
    discovery_interval: float = setting(
        5.0, unit="s", gt=0, metavar="S",
        help="seconds between DNS lookups of dns:// workers and checks of --workers-file")
    worker_ca_file: str | None = setting(
        None, metavar="PATH",
        help="PEM CA bundle that https:// workers' certificates are verified against (only it is trusted; "
             "default: the system's CAs)")
    worker_insecure: bool = setting(
        False, help="do not verify https:// workers' certificates (testing only; logged as a warning)")
    policy: str = setting(
        "least-outstanding", choices=POLICIES,
        help="routing policy: least outstanding requests, session affinity (rendezvous hashing on a "
             "session header, bounded load), cache-aware (longest prefix match, least outstanding when "
             "load is imbalanced) or kv-aware (the engines' KV cache events against load)")
    session_headers: str = setting(
        DEFAULT_SESSION_HEADERS, metavar="NAMES",
        help="session policy: comma-separated headers the session key is read from, the first present wins")
    session_balance_epsilon: float = setting(
        1.0, metavar="E",
        help="session policy: a worker takes keyed requests while its outstanding count is below "
             "ceil((1 + E) x (all outstanding + 1) / workers)")
    cache_threshold: float = setting(
        0.3, le=1,
        help="cache-aware policy: share of the prompt (0-1) the longest cached prefix must exceed to route "
             "by it")
    balance_abs_threshold: int = setting(
        64,
        help="cache-aware policy: load is imbalanced when the most and fewest outstanding requests differ "
             "by more than this...")
    balance_rel_threshold: float = setting(1.5, help="...and the most exceeds this times the fewest")
    max_tree_tokens: int = setting(
        1 << 20, unit="tokens", gt=0,
        help="cache-aware policy: tokens (text: characters) each worker holds in the prefix tree; its "
             "least recently used leaves are evicted past it")
    max_tree_nodes: int = setting(
        1 << 16, gt=0, help="cache-aware policy: nodes each worker holds in the prefix tree")
    kv_overlap_weight: float = setting(
        1.25, help="kv-aware policy: cost of each prompt token the worker's KV cache does not hold")
    kv_queued_weight: float = setting(
        0.0, ge=0,
        help="kv-aware policy: cost of each prefill token queued on the worker (routed there, not stored yet) "
             "that the request does not share; 0 = not counted")
    kv_load_weight: float = setting(
        128.0, unit="tokens",
        help="kv-aware policy: cost of each request outstanding on the worker, in prompt tokens")
    kv_active_weight: float = setting(
        0.0, ge=0,
        help="kv-aware policy: cost of each token the worker's running requests hold in its KV cache (their "
             "prompts and the tokens generated so far: Dynamo's decode blocks), this replica's requests counted "
             "as they run, the other replicas' from the engine's load reading; 0 = not counted")
    kv_predict_ttl: float = setting(
        5.0, unit="s",
        help="kv-aware policy: seconds a routed request's blocks count as held on its worker (its siblings "
             "follow it before the engine's events arrive) and, until the engine stores them, as queued "
             "prefill")
    kv_load_interval: float = setting(
        0.1, unit="s", ge=0,
        help="kv-aware policy: seconds between readings of each engine's own load (SGLang GET /v1/loads, "
             "vLLM GET /metrics), which every frontend replica reads alike; 0 = weigh only this replica's "
             "own outstanding requests")
    kv_load_idle_interval: float = setting(
        1.0, unit="s", ge=0,
        help="kv-aware policy: seconds an engine's load reading of no requests may stand while this replica "
             "routes nothing there and the engine publishes no KV event; 0 = read every engine every "
             "--kv-load-interval")
    kv_events: list[tuple[str, str, str | None]] = setting(
        factory=list, item=parse_kv_source, item_text=kv_source_text,
        metavar="URL=ENDPOINT[+REPLAY]",
        help="kv-aware policy: where a worker publishes its KV events (tcp://HOST:PORT, and its replay "
             "socket after +), instead of asking its discovery route (vLLM /kv_event_sources, SGLang "
             "/server_info)")
    connect_timeout: float = setting(5.0, unit="s", gt=0, help="seconds to connect to a worker")
    headers_timeout: float = setting(
        60.0, unit="s",
        help="seconds from sending a streamed engine leg to its response headers; 0 = none")
    first_token_timeout: float = setting(
        1800.0, unit="s",
        help="seconds from a streamed leg's headers to its first event (queueing and prefill); 0 = none")
    inter_token_timeout: float = setting(
        300.0, unit="s", old_names=("read_timeout",),
        help="seconds a streamed leg may go without an SSE event (comments do not count); 0 = none; "
             "--read-timeout is its old name")
    request_timeout: float = setting(
        0.0, unit="s", help="seconds a unary engine leg may take in all; 0 = none")
    migration_limit: int = setting(
        3, metavar="N",
        help="resumed attempts a stream may make after its first when workers die mid-answer; "
             "0 = no migration")
    max_concurrent_migrations: int = setting(
        0, metavar="N",
        help="migrated streams (resumed or replayed) running at once in this process, each holding its "
             "slot to its last token; more wait their turn after their backoff; 0 = twice the workers' "
             "count")
    migration_wait: float = setting(
        30.0, unit="s", gt=0,
        help="seconds a migrated stream may wait for a --max-concurrent-migrations slot before it ends "
             "with the format's error")
    resume_after_pause: bool = setting(
        False,
        help="hold a stream the engine aborted for a fleet transaction the frontend sent (SGLang "
             "pause_generation abort, vLLM pause?mode=abort, an SGLang weight route with abort_all_requests, "
             "true by default for update_weight_version) and resume it after the fleet's resume (or that "
             "route's answer), on the new weights; a request's asgi-generate-resume-after-pause header (1 or "
             "0) overrides it")
    pause_hold_limit: int = setting(
        4096, gt=0, metavar="N",
        help="streams held across pauses at once; one more ends with 503")
    pause_hold_timeout: float = setting(
        600.0, unit="s", gt=0,
        help="seconds a stream is held for the fleet's resume; past it, it ends with 503")
    fleet_state_interval: float = setting(
        1.0, unit="s", ge=0,
        help="seconds between readings of every engine's pause state and weight version (SGLang GET /ready "
             "and /model_info, vLLM GET /is_paused and /weight_info), through which every process of every "
             "replica learns a pause, a resume and a new weight version; 0 = no reading (only the calls this "
             "process takes, and what its siblings tell it)")
    fleet_state_paused_interval: float = setting(
        0.1, unit="s", gt=0,
        help="seconds between readings of a paused fleet's pause route (its weight versions are read every "
             "--fleet-state-interval still, and at once on the resume), so held streams resume soon after "
             "the engines do")
    admission: bool = setting(
        False,
        help="admission control (docs/overload.md): a request waits in a bounded queue until its engines "
             "have room by their own load figures, ordered by priority class, tenant share, group and "
             "deadline; past the queue's bounds it is shed with 429 and Retry-After")
    admission_worker_requests: int = setting(
        64, gt=0, metavar="N",
        help="admission: engine requests (running plus waiting, every frontend's) one worker takes before "
             "it counts as full")
    admission_waiting_tokens: int = setting(
        0, unit="tokens", metavar="N",
        help="admission: a worker whose engine reports this many uncached prompt tokens waiting for prefill "
             "counts as full; 0 = no such bound")
    admission_kv_usage: float = setting(
        0.0, le=1,
        help="admission: a worker whose engine reports its KV cache this full (a fraction: SGLang token_usage, "
             "vLLM vllm:kv_cache_usage_perc) counts as full; 0 = no such bound")
    admission_load_interval: float = setting(
        0.1, unit="s", gt=0,
        help="admission: seconds between readings of each engine's load (SGLang /v1/loads, vLLM /metrics) "
             "while requests wait in this process's queue or less than half the fleet's room is free")
    admission_load_idle_interval: float = setting(
        1.0, unit="s", ge=0,
        help="admission: seconds between readings of each engine's load while no request waits and at least "
             "half the room is free (a request that has to wait makes the readers read at once); 0 = always "
             "--admission-load-interval")
    admission_load_stale: float = setting(
        1.0, unit="s", gt=0,
        help="admission: a load reading overdue by this many seconds (past the pace it was taken at) counts "
             "its worker as full, never as empty")
    admission_classes: str = setting(
        "eval,agent,rollout,bulk", metavar="NAMES",
        help="admission: the priority classes, highest first, named by a request's x-priority-class header")
    admission_default_class: str = setting(
        "rollout", metavar="NAME", help="admission: the class of a request that names none")
    admission_reserved_share: float = setting(
        0.05, le=1,
        help="admission: the share of the fleet's room each class may take even while a higher class "
             "waits, so that no class is starved")
    admission_promote_after: float = setting(
        30.0, unit="s", gt=0,
        help="admission: a request waiting this long is ordered as one class higher (two after twice as long)")
    admission_engine_priority: str = setting(
        "", metavar="CLASS=P,...",
        help="admission: the engines' own priority field sent for each class (SGLang and vLLM priority, as "
             "given: vLLM schedules lower values first, SGLang by its --schedule-low-priority-values-first) "
             "where the client's body has none; only engines started with priority scheduling act on it (others "
             "ignore it, save SGLang with --abort-on-priority-when-disabled, which refuses it)")
    admission_tenant_weights: str = setting(
        "", metavar="TENANT=W,...",
        help="admission: tenants' weights in their class's share (others weigh 1); the tenant is the "
             "x-tenant header, else a hash of the bearer token")
    admission_output_weight: float = setting(
        2.0,
        help="admission: a tenant's work is its uncached prompt tokens plus this times its output tokens")
    admission_max_tenants: int = setting(
        1000, gt=0, metavar="N",
        help="admission: tenants tracked by name per class; more share one counter and one metrics label")
    admission_preemption: bool = setting(
        False,
        help="admission: while a higher class waits for room, preempt running streams of lower classes that "
             "opted in (x-preemptible: 1): abort them on the engine, park them, and resume them exactly as "
             "migrated legs when they get room again")
    admission_max_parked: int = setting(
        256, gt=0, metavar="N",
        help="admission: preempted streams parked at once; a stream is not preempted past it (a parked "
             "stream waits at most --admission-queue-wait, then ends with 503 in-band)")
    admission_queue_depth: int = setting(
        1024, gt=0, metavar="N",
        help="admission: requests waiting per class; one more is shed with 429")
    admission_queue_bytes: int = setting(
        64 * 1024 * 1024, unit="bytes", gt=0,
        help="admission: request body bytes waiting per class; one more is shed with 429")
    admission_queue_wait: float = setting(
        30.0, unit="s", gt=0,
        help="admission: seconds a request may wait for room (during a fleet pause too); past it, 429")
    health_interval: float = setting(
        2.0, unit="s", gt=0,
        help="seconds between health probes of each worker; in whole seconds (at least 1), the Retry-After of "
             "the 503 when no worker can take a request")
    health_timeout: float = setting(30.0, unit="s", gt=0, help="seconds one health probe may take")
    health_failures: int = setting(
        3, gt=0,
        help="failed health probes in a row that take an up worker out of the rotation and end its "
             "in-flight requests; a refused or broken connection does at once")
    sse_keepalive: float = setting(
        15.0, unit="s", help="seconds of stream silence before a keep-alive comment; 0 = never")
    abort_timeout: float = setting(
        10.0, unit="s", gt=0,
        help="seconds an engine has to answer an abort request; a slow one is never re-sent, a non-200 "
             "answer is retried")
    abort_concurrency: int = setting(
        8, gt=0,
        help="abort requests in flight at once per worker, each on its own kept-alive connection")
    abort_queue_size: int = setting(
        16384, gt=0, help="aborts that may wait per worker; more are refused and counted unacknowledged")
    abort_batch: int = setting(
        512, gt=0,
        help="engine ids per abort request where the engine takes a list (vLLM /abort_requests)")
    abort_deadline: float = setting(
        30.0, unit="s", gt=0,
        help="seconds a request's end waits, at most, for its aborts' answers, queueing included")
    abort_memory: int = setting(
        65536, gt=0,
        help="engine ids per worker whose abort's answer is kept, so that a repeated abort of one (an admin "
             "abort, a disconnect) is answered without sending a second")
    admin_token: str | None = setting(
        None, metavar="TOKEN",
        help="require 'Authorization: Bearer TOKEN' on admin routes (default: open; prefer the variable, "
             "which ps does not show)")
    admin_timeout: float = setting(
        60.0, unit="s", gt=0, help="seconds an admin route waits for each worker's answer")
    weight_update_timeout: float = setting(
        600.0, unit="s", gt=0,
        help="seconds each step of a weight update (a weight route: group set-up, load, version) waits for "
             "each worker's answer; past it the step answers 502 naming the worker")
    shutdown_grace: float = setting(
        30.0, unit="s",
        help="seconds in-flight requests get to finish on SIGTERM/SIGINT before they are aborted and "
             "ended cleanly")
    embedded_workers: int = setting(
        2, gt=0, help="simulated workers started when no --worker is given")
    embedded_pd: bool = setting(
        False,
        help="with the simulated workers, also start a prefill and a decode simulator per protocol, so "
             "requests run as P/D pairs")
    embedded_ttft_ms: float = setting(
        0.0, unit="ms", help="simulated workers' time to first token in ms")
    embedded_itl_ms: float = setting(0.0, unit="ms", help="simulated workers' inter-token latency in ms")
    skip_broken_codecs: bool = setting(
        False, help="start even if an installed codec fails to load (it is logged and skipped)")
    trace_file: str | None = setting(
        None, metavar="PATH",
        help="write one JSONL request-end record per request to files named PATH.<pid>.<start>.<n>.jsonl "
             "(PATH less any .jsonl suffix) in an existing folder; tracing is off unless this or "
             "--trace-stderr is given")
    trace_stderr: bool = setting(False, help="write the trace records to stderr too")
    trace_queue_size: int = setting(
        4096, gt=0, help="records that may wait for the trace writer; more are dropped and counted")
    trace_rotate_bytes: int = setting(
        256 * 1024 * 1024, unit="bytes", help="start a new trace file past this many bytes; 0 = never")
    trace_block_size: int = setting(
        64, unit="tokens", gt=0, help="tokens per replay block hash in trace records")
    tokenizer: str | None = setting(
        None, metavar="PATH",
        help="a Hugging Face tokenizer.json, loaded at start: a migrated stream's text prompt is "
             "tokenized with it and its stop strings checked across the seam, and the trace output "
             "parsers below find their marker tokens with it")
    reasoning_parser: str | None = setting(
        None, metavar="NAME",
        help="count reasoning tokens in traces: qwen3, deepseek_r1 or an installed parser")
    tool_call_parser: str | None = setting(
        None, metavar="NAME",
        help="record tool-call names and the tool_calls finish reason in traces: hermes or an installed "
             "parser")
    otlp_endpoint: str | None = setting(
        None, metavar="URL",
        help="OTLP/HTTP collector (http://HOST:4318): a span per request, a child span per engine leg, a "
             "traceparent to each engine; the OTEL_* variables apply")
    trace_otlp: bool = setting(
        False, help="also export the request-end records to --otlp-endpoint as OTLP log records")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "Settings":
        """Settings from ``ASGI_GENERATE_*`` variables; unset or empty ones
        keep their defaults. ``ASGI_GENERATE_WORKERS`` (``..._PREFILL``,
        ``..._DECODE``) is a comma-separated list of
        ``PROTOCOL=http://HOST:PORT`` (or ``dns://NAME:PORT``); booleans are ``1/0``,
        ``true/false``, ``yes/no`` or ``on/off``. An old name
        (``ASGI_GENERATE_READ_TIMEOUT``) sets its setting unless the new one
        is set too.

        Raises:
            ValueError: a variable does not parse, or an ``ASGI_GENERATE_*``
                variable names no setting (a typo would otherwise be
                ignored): the nearest known name is suggested (difflib).
        """
        known = {s.env: s for s in SETTINGS.values()}
        old = {var: s for s in SETTINGS.values() for var in s.old_envs}
        unknown = sorted(k for k in environ if k.startswith(ENV_PREFIX) and k not in known and k not in old)
        if unknown:
            names = [var.removeprefix(ENV_PREFIX) for var in [*known, *old]]  # the prefix matches them all
            near = difflib.get_close_matches(unknown[0].removeprefix(ENV_PREFIX), names, n=1)
            hint = f"did you mean {ENV_PREFIX}{near[0]}?" if near else "no setting has a name like it"
            raise ValueError(f"unknown variable {unknown[0]}: {hint} (asgi-generate serve --help lists the settings)")
        values: dict[str, Any] = {}
        # Old names first, so that the new name wins when both are set.
        for var, s in [*old.items(), *known.items()]:
            raw = environ.get(var)
            if raw:
                values[s.name] = s.parse(raw, var)
        return cls(**values)

    def check(self) -> None:
        """Refuse settings the server cannot run with, before anything starts.

        Every setting within its declared choices and bounds; the session
        headers must name one. ``workers_file`` and ``worker_ca_file`` must
        load; ``trace_file`` must name a file in an existing folder (the
        folder is not created: a typo should not scatter trace files).
        ``tokenizer``, when given, must load; the trace parsers need a trace
        sink, ``trace_otlp`` a collector.

        Raises:
            ValueError: one line naming the flag and variable at fault.
        """
        for s in SETTINGS.values():
            fault = s.fault(getattr(self, s.name))
            if fault is not None:
                raise ValueError(f"{s.label} {fault}")
        if not any(h.strip() for h in self.session_headers.split(",")):
            raise ValueError(f"{_label('session_headers')} names no header")
        classes = [c.strip() for c in self.admission_classes.split(",") if c.strip()]
        if not classes or len(set(classes)) != len(classes):
            raise ValueError(f"{_label('admission_classes')} must name distinct classes")
        if self.admission_default_class not in classes:
            raise ValueError(f"{_label('admission_default_class')} {self.admission_default_class!r} is not one "
                             f"of {', '.join(classes)}")
        for name, parse in (("admission_tenant_weights", lambda t: parse_weights(t)),
                            ("admission_engine_priority", lambda t: parse_priorities(t, classes))):
            try:
                parse(getattr(self, name))
            except ValueError as exc:
                raise ValueError(f"{_label(name)}: {exc}") from None
        if self.workers_file is not None:
            try:
                read_workers_file(self.workers_file)
            except ValueError as exc:
                raise ValueError(f"{_label('workers_file')}: {exc}") from None
        if self.worker_ca_file is not None:
            try:
                ssl.create_default_context(cafile=self.worker_ca_file)
            except (OSError, ssl.SSLError) as exc:
                why = getattr(exc, "reason", None) or exc.strerror or exc
                raise ValueError(f"{_label('worker_ca_file')}: cannot load {self.worker_ca_file!r}: {why}") from None
        if self.trace_file is not None:
            folder = pathlib.Path(self.trace_file).expanduser().absolute().parent
            if not folder.is_dir():
                raise ValueError(f"{_label('trace_file')}: folder {str(folder)!r} does not exist")
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
                raise ValueError(f"{_label('otlp_endpoint')} must be an http(s)://HOST[:PORT] URL, "
                                 f"not {self.otlp_endpoint!r}")
        if self.trace_otlp and not self.otlp_endpoint:
            raise ValueError("--trace-otlp exports records to the --otlp-endpoint collector: give one")

    def to_env(self) -> dict[str, str]:
        """The environment variables that reproduce these settings."""
        return {s.env: s.text(value) for s in SETTINGS.values() if (value := getattr(self, s.name)) is not None}


def _declared() -> dict[str, Setting]:
    hints = get_type_hints(Settings)
    return {f.name: replace(f.metadata["setting"], name=f.name, kind=hints[f.name]) for f in fields(Settings)}


#: Every setting's declaration by name, in :class:`Settings`' order.
SETTINGS: dict[str, Setting] = _declared()


def _label(name: str) -> str:
    return SETTINGS[name].label


def settings_table() -> str:
    """The settings table of docs/configuration.md (Markdown, no final
    newline; docs/settings_table.py writes it there): a row per
    setting, in :class:`Settings`' order, with its variables, flags,
    default (and unit) and help text."""
    defaults = Settings()
    rows = ["| variable | flag | default | what |", "|---|---|---|---|"]
    for s in SETTINGS.values():
        old = " (old name)" if s.old_names else ""
        variables = ", ".join(f"`{var}`" for var in (s.env, *s.old_envs)) + old
        value = f" {s.metavar}" if s.metavar else f" {'|'.join(s.choices)}" if s.choices else ""
        flags = ", ".join([f"`{s.flags[0]}{value}`", *(f"`{f}`" for f in s.flags[1:])]) + old
        if s.kind is bool:
            flags += f" / `--no-{s.flags[0][2:]}`"
        default = s.default_text or s.shown(getattr(defaults, s.name))
        if s.unit and not s.default_text:
            default += f" {s.unit}"
        rows.append(" | ".join(["", variables, _markdown(flags), _markdown(default), _markdown(s.help), ""]).strip())
    return "\n".join(rows)


def _markdown(text: str) -> str:
    """``text`` in a Markdown table cell: its pipes, emphasis stars and angle brackets as themselves."""
    return text.replace("|", "\\|").replace("*", "\\*").replace("<", "&lt;").replace(">", "&gt;")
