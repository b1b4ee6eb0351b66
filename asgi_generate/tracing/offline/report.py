"""``replay --report FILE.html``: the replay's parameters, summary, error
breakdown and plots in one self-contained HTML file (PNG images embedded as
base64), for people who would rather look than read.

The summary is the one the replay prints (replaying records: the recorded
figures beside the replayed ones); the error breakdown gives each kind of
failure, its count and what the first one said. Plots (matplotlib,
headless ``Agg`` backend): the TTFT, ITL and end-to-end latency
distributions (ITL on log-spaced bins and a log axis: gaps span
microseconds to seconds); output tokens per second over the replay (1 s
bins, from the streamed events' arrival); and each request's TTFT and
end-to-end latency by its send time.

Needs the ``report`` extra (``pip install asgi-generate[report]``).
"""

from __future__ import annotations

import base64
import html
import io
from typing import Sequence

from ...exceptions import ReportUnavailable
from .replay import Result, errors_by_kind, latency_series

#: Seconds per bin of the throughput plot.
BIN_S = 1.0


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=96, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{cells}</tr>{body}</table>"


def write_report(path: str, title: str, parameters: Sequence[tuple[str, str]], summary_text: str,
                 results: Sequence[Result]) -> int:
    """Write the HTML report to ``path``: ``parameters`` (what the replay
    was run with, ``(name, value)``), ``summary_text``, the error breakdown
    of ``results`` and the plots; returns the number of plots.

    Raises:
        ReportUnavailable: matplotlib is missing.
        OSError: ``path`` cannot be written.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ReportUnavailable("--report needs matplotlib: pip install 'asgi-generate[report]'") from None
    ok = [r for r in results if r.ok]
    images = []
    series = latency_series(ok)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.5))
    for ax, (name, values) in zip(axes, series.items()):
        ms = [v * 1000 for v in values]
        bins: int | list[float] = 40
        if name == "itl":
            positive = [v for v in ms if v > 0]
            if positive and max(positive) > min(positive):
                low, high = min(positive), max(positive)
                bins = [low * (high / low) ** (i / 40) for i in range(41)]
            ax.set_xscale("log")
        ax.hist(ms, bins=bins, color="#3b75af")
        ax.set_title(f"{name.upper()} ({len(values)} samples)")
        ax.set_xlabel("ms, log scale" if name == "itl" else "ms")
        ax.set_ylabel("count")
    images.append(("Latency distributions", _png(fig)))
    plt.close(fig)

    bins: dict[int, int] = {}
    for r in results:
        before = 0
        for t, tokens in r.events:
            bins[int(t // BIN_S)] = bins.get(int(t // BIN_S), 0) + tokens - before
            before = tokens
    fig, ax = plt.subplots(figsize=(13, 3.5))
    xs = list(range(max(bins) + 1)) if bins else []
    ax.plot([x * BIN_S for x in xs], [bins.get(x, 0) / BIN_S for x in xs], color="#3b75af")
    ax.set_xlabel("s since start")
    ax.set_ylabel("output tokens/s")
    images.append(("Throughput over time", _png(fig)))
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(13, 3.5))
    ax.scatter([r.start for r in ok], [r.e2e * 1000 for r in ok], s=6, label="end to end")
    ax.scatter([r.start for r in ok if r.ttft is not None], [r.ttft * 1000 for r in ok if r.ttft is not None],
               s=6, label="TTFT")
    ax.set_xlabel("sent at, s since start")
    ax.set_ylabel("ms")
    ax.legend()
    images.append(("Latency by send time", _png(fig)))
    plt.close(fig)

    errors = errors_by_kind(results)
    parts = [f"<!doctype html><meta charset=utf-8><title>{html.escape(title)}</title>",
             "<style>body{font-family:sans-serif;margin:2em}pre{background:#f4f4f4;padding:1em}"
             "td,th{padding:0.2em 1em;text-align:left}</style>",
             f"<h1>{html.escape(title)}</h1>",
             "<h2>Parameters</h2>" + _table(("parameter", "value"), parameters),
             f"<h2>Summary</h2><pre>{html.escape(summary_text)}</pre>",
             "<h2>Errors</h2>" + (_table(("kind", "requests", "the first one said"), errors) if errors
                                  else "<p>none</p>")]
    for caption, data in images:
        parts.append(f'<h2>{caption}</h2><img alt="{caption}" src="data:image/png;base64,{data}">')
    with open(path, "w") as f:
        f.write("\n".join(parts) + "\n")
    return len(images)
