"""Frontend settings, from command-line flags or environment variables.

Every setting has a flag (``asgi-generate serve --help``) and an environment
variable ``ASGI_GENERATE_<NAME>``, so ``hypercorn asgi_generate.asgi:app``
serves the same app as ``asgi-generate serve``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Mapping

from .workers.router import parse_worker_spec

ENV_PREFIX = "ASGI_GENERATE_"


@dataclass(slots=True)
class Settings:
    """The frontend's configuration.

    Attributes:
        workers: ``(protocol, url)`` pairs; empty starts embedded simulators.
        max_body_bytes: request body cap; larger bodies get 413.
        connect_timeout: seconds to connect to a worker.
        read_timeout: seconds a worker may stay silent mid-response.
        health_interval: seconds between probes of a down worker.
        sse_keepalive: seconds of silence before an SSE keep-alive comment
            (0 disables them).
        abort_timeout: seconds to wait for an engine's abort acknowledgement,
            per try (three tries, with backoff).
        slow_client_timeout: seconds a client may leave one write untaken
            before it is cut off (``slow_client``) and the engine aborted.
        shutdown_grace: seconds in-flight requests get to finish after
            SIGTERM/SIGINT before they are aborted and ended cleanly.
        embedded_workers: simulators started per protocol when no worker is given.
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
        tokenizer: a Hugging Face ``tokenizer.json`` the trace writer decodes
            output with, for the parsers below.
        reasoning_parser, tool_call_parser: output parsers for the trace
            (``qwen3``/``deepseek_r1``, ``hermes``, or installed ones).
    """

    workers: list[tuple[str, str]] = field(default_factory=list)
    max_body_bytes: int = 32 * 1024 * 1024
    connect_timeout: float = 5.0
    read_timeout: float = 300.0
    health_interval: float = 2.0
    sse_keepalive: float = 15.0
    abort_timeout: float = 2.0
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

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "Settings":
        """Settings from ``ASGI_GENERATE_*`` variables; unset ones keep their
        defaults. ``ASGI_GENERATE_WORKERS`` is a comma-separated list of
        ``PROTOCOL=http://HOST:PORT``.

        Raises:
            ValueError: a variable does not parse.
        """
        values: dict = {}
        for f in fields(cls):
            raw = environ.get(ENV_PREFIX + f.name.upper())
            if raw is None or raw == "":
                continue
            if f.name == "workers":
                values["workers"] = [parse_worker_spec(s.strip()) for s in raw.split(",") if s.strip()]
            elif f.type == "bool":
                values[f.name] = raw.lower() in ("1", "true", "yes", "on")
            elif f.type == "str | None":
                values[f.name] = raw
            else:
                try:
                    values[f.name] = (int if f.type == "int" else float)(raw)
                except ValueError:
                    raise ValueError(f"{ENV_PREFIX}{f.name.upper()}={raw!r} is not a number") from None
        return cls(**values)

    def to_env(self) -> dict[str, str]:
        """The environment variables that reproduce these settings."""
        env = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if f.name == "workers":
                value = ",".join(f"{p}={u}" for p, u in value)
            elif isinstance(value, bool):
                value = "1" if value else "0"
            env[ENV_PREFIX + f.name.upper()] = str(value)
        return env
