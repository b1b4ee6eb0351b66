"""What the observability hooks cost per request, in process, side by side.

- Prometheus: ``Recorder.request_started`` + ``request_ended`` +
  ``request_finished`` of a finished one-leg streamed request, with the real
  metrics and with a no-op stand-in, in one process (counts added up in
  memory, moved into prometheus-client on scrape) and, in a child process, in
  prometheus-client's multiprocess mode (values in mmap'd files, as under
  ``serve --workers N``), where each process moves its counts into the files
  once a second: also with that move after every :data:`MOVE_EVERY` requests
  (its cost spread over them, as at that many requests per second), and after
  every request (how multiprocess mode counted before: the files written at
  once).
- OpenTelemetry: the response-path part (``Otlp.stamp`` of one engine leg,
  minting the request's trace context on the way) with ``--otlp-endpoint``
  set, against the ``recorder.otel is None`` check it costs when off.

    .venv/bin/python bench/bench_observability.py        # about 20 seconds

Prints one Markdown table (microseconds per request and the ratios).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

N = 100_000
#: Requests per move of the counts into the files (multiprocess mode): one
#: move a second at 1,000 requests/s per process.
MOVE_EVERY = 1_000


def _state():
    from asgi_generate.tracing.state import RequestState
    from asgi_generate.tracing.state import LegRecord as Attempt

    st = RequestState("0" * 32, "sglang", "/generate", "POST")
    st.status, st.http_status, st.stream = "ok", 200, True
    st.input_length, st.output_tokens, st.body_bytes = 128, 16, 900
    st.t_first_token, st.t_last_token, st.t_done = st.t_received + 0.05, st.t_received + 0.2, st.t_received + 0.21
    st.attempts.append(Attempt("1" * 32, "aggregated", "w0", outcome="finished", tokens=16))
    return st


class _NoMetrics:
    def request_started(self) -> None:
        pass

    def request_ended(self, st) -> None:
        pass

    def request_finished(self, st) -> None:
        pass


def per_request_us(fn, n: int = N) -> float:
    """Best of three runs of ``n`` calls, in microseconds per call."""
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, time.perf_counter() - t)
    return best / n * 1e6


def metrics_us() -> tuple[float, float, float, float]:
    """(with metrics, with the no-op stand-in, with metrics and a move into
    the files every :data:`MOVE_EVERY` requests, and after every request)
    for this process's mode."""
    from asgi_generate.config import Settings
    from asgi_generate.ops.recorder import Recorder

    recorder = Recorder(Settings(workers=[("sglang", "http://127.0.0.1:9")]))
    st = _state()

    def one() -> None:
        recorder.request_started()
        recorder.request_ended(st)
        recorder.request_finished(st)

    with_metrics = per_request_us(one)
    metrics = recorder.metrics

    def batch() -> None:
        for _ in range(MOVE_EVERY):
            one()
        metrics.flush()

    def at_once() -> None:
        one()
        metrics.flush()

    moved = per_request_us(batch, N // MOVE_EVERY) / MOVE_EVERY
    every = per_request_us(at_once)
    recorder.metrics = _NoMetrics()
    return with_metrics, per_request_us(one), moved, every


def otel_us() -> tuple[float, float]:
    """(stamp with OTel on, the check with it off)."""
    from asgi_generate.tracing.state import LegRecord as Attempt
    from asgi_generate.sdk._codec import WorkerRequest
    from asgi_generate.config import Settings
    from asgi_generate.tracing.otlp import Otlp

    otlp = Otlp(Settings(otlp_endpoint="http://127.0.0.1:9"))
    base = _state()

    def on() -> None:
        base.trace = None  # every request mints its trace context at its first leg
        otlp.stamp(base, Attempt("1" * 32), WorkerRequest(b"/generate", b"{}"))

    app_otel = None

    def off() -> None:
        if app_otel is not None:
            raise AssertionError
        Attempt("1" * 32), WorkerRequest(b"/generate", b"{}")

    return per_request_us(on), per_request_us(off)


def main() -> None:
    if sys.argv[1:] == ["--child"]:
        print(*metrics_us())
        return
    single = metrics_us()[:2]
    with tempfile.TemporaryDirectory() as folder:
        out = subprocess.run([sys.executable, __file__, "--child"], capture_output=True, text=True, check=True,
                             env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": folder}).stdout
    multi, off, moved, every = (float(x) for x in out.split())
    on, otel_off = otel_us()
    print("| hook | on (µs/request) | off (µs/request) | added (µs) | on/off |")
    print("|---|---:|---:|---:|---:|")
    for name, (a, b) in (("metrics, one process", single), ("metrics, multiprocess mode", (multi, off)),
                         (f"metrics, multiprocess mode, moved every {MOVE_EVERY:,} requests", (moved, off)),
                         ("metrics, multiprocess mode, moved at every request (before)", (every, off)),
                         ("OTel stamp of one leg", (on, otel_off))):
        print(f"| {name} | {a:.2f} | {b:.2f} | {a - b:.2f} | {a / b:.1f}x |")


if __name__ == "__main__":
    main()
