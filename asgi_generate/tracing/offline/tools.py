"""``asgi-generate-trace``: offline tools for request-end trace files.

Subcommands (each takes one or more JSONL files, e.g. every
``trace.<pid>.<start>.<n>.jsonl`` of a run):

- ``validate FILE...``: the v1 schema plus the accounting laws of
  :mod:`.validate`, and request ids unique across all files. Prints each
  violation and a verdict; exits 1 on any violation, 2 if a file cannot be
  read.
- ``summarize FILE...``: a table of requests by status, format and finish
  reason, token totals, and TTFT / total latency percentiles.
- ``schema``: print the v1 JSON Schema (the source of
  ``trace/request_trace.v1.schema.json``).
- ``export-mooncake FILE...``: the Mooncake replay trace (FAST'25 Mooncake
  traces, as Dynamo's and AIPerf's replay read them): one JSON object per
  line, ``{"timestamp", "input_length", "output_length", "hash_ids",
  "block_size"}``, in arrival order. ``timestamp`` is ms since the first
  exported request; ``hash_ids`` renumber the records' block hashes from 0
  in order of first appearance, so equal ids mean an equal prefix;
  ``block_size`` (tokens per hash id) travels in every row, so ``replay``
  draws blocks of the recorded size. Only records with block hashes that
  reached an engine are exported; all must share one block size, which is
  also reported on stderr with the counts.
- ``replay FILE... --url URL``: send the records' (or a Mooncake trace's)
  requests to a frontend again at their arrival times, with a progress bar,
  a summary and an optional HTML report (:mod:`.replay`, :mod:`.report`);
  exits 1 when any request failed, 2 on unusable input.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from typing import Iterable, Sequence

import orjson

from ...exceptions import EngineLoadError
from ...protocols import PROTOCOLS
from ..schema import schema_json
from .rows import mooncake_rows, percentile
from .validate import check_records, read_jsonl


def _records(paths: Sequence[str]) -> Iterable[tuple[str, object]]:
    for path in paths:
        yield from read_jsonl(path)


def _valid(paths: Sequence[str]) -> list[dict]:
    return [rec for _, rec in _records(paths) if isinstance(rec, dict)]


def cmd_validate(paths: Sequence[str]) -> int:
    """Print violations and a verdict; 0 if all valid, else 1."""
    count, problems = check_records(_records(paths))
    for p in problems:
        print(p)
    if problems:
        print(f"INVALID: {len(problems)} violations in {count} records")
        return 1
    print(f"VALID: {count} records")
    return 0


def _counts_table(title: str, counter: Counter) -> list[str]:
    rows = [f"{title}:"]
    for key, n in sorted(counter.items(), key=lambda kv: (-kv[1], kv[0])):
        rows.append(f"  {key:<24} {n:>8}")
    return rows


def summarize(records: Sequence[dict]) -> str:
    """The ``summarize`` table for ``records``, as text."""
    lines = [f"requests: {len(records)}"]
    lines += _counts_table("by status", Counter(r.get("status", "?") for r in records))
    lines += _counts_table("by format", Counter(r.get("format", "?") for r in records))
    lines += _counts_table(
        "by finish reason", Counter(r.get("finish", {}).get("finish_reason", "(none)") for r in records)
    )
    lines.append("tokens:")
    for key in ("input_tokens", "output_tokens", "cached_tokens", "reasoning_tokens"):
        lines.append(f"  {key:<24} {sum(r.get(key, 0) for r in records):>8}")
    lines.append(f"latency ms {'n':>13} {'p50':>10} {'p90':>10} {'p99':>10} {'max':>10}")
    for key in ("ttft_ms", "total_ms"):
        values = [r[key] for r in records if key in r]
        if values:
            cells = "".join(f" {percentile(values, p):>10.1f}" for p in (50, 90, 99, 100))
            lines.append(f"  {key:<12} {len(values):>9}{cells}")
        else:
            lines.append(f"  {key:<12} {0:>9}")
    return "\n".join(lines)


def cmd_export_mooncake(paths: Sequence[str]) -> int:
    """Write Mooncake rows to stdout; 0, or 1 on mixed block sizes."""
    try:
        rows, skipped, block_size = mooncake_rows(_valid(paths))
    except ValueError as exc:
        print(f"asgi-generate-trace: {exc}", file=sys.stderr)
        return 1
    out = sys.stdout.buffer
    for row in rows:
        out.write(orjson.dumps(row) + b"\n")
    out.flush()
    print(f"exported {len(rows)} requests (block_size {block_size}), skipped {skipped} "
          f"without block hashes or engine attempts", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``asgi-generate-trace`` console script."""
    parser = argparse.ArgumentParser(prog="asgi-generate-trace", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_ in (
        ("validate", "check records against the schema and the accounting laws"),
        ("summarize", "print a summary table"),
        ("export-mooncake", "write the Mooncake replay trace to stdout"),
    ):
        sub.add_parser(name, help=help_).add_argument("files", nargs="+", metavar="FILE")
    sub.add_parser("schema", help="print the record JSON Schema")
    try:  # --format's choices are the installed engines'
        _replay_parser(sub)
    except EngineLoadError as exc:
        for line in str(exc).splitlines():
            print(f"asgi-generate-trace: {line}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if args.command == "schema":
        sys.stdout.buffer.write(schema_json())
        return 0
    try:
        if args.command == "replay":
            return cmd_replay(args)
        if args.command == "validate":
            return cmd_validate(args.files)
        if args.command == "summarize":
            print(summarize(_valid(args.files)))
            return 0
        return cmd_export_mooncake(args.files)
    except OSError as exc:
        print(f"asgi-generate-trace: {exc}", file=sys.stderr)
        return 2


def _replay_parser(sub) -> None:
    rp = sub.add_parser("replay", help="send recorded requests to a frontend again, at their arrival times",
                        description="Replay request_end records or a Mooncake trace against a frontend.")
    rp.add_argument("files", nargs="+", metavar="FILE", help="request_end JSONL files, or one Mooncake trace")
    rp.add_argument("--url", required=True, help="the frontend's base URL, e.g. http://127.0.0.1:8000")
    formats = [e.name for e in PROTOCOLS.where(replay_body=True)]
    rp.add_argument("--format", choices=formats, default=formats[0] if formats else None,
                    help="native route to send to (default %(default)s)")
    rp.add_argument("--speedup", type=_above_zero, default=1.0,
                    help="divide the recorded arrival times by this (default %(default)s)")
    rp.add_argument("--block-size", type=_count(1), default=None, metavar="N",
                    help="tokens per hash id of a Mooncake trace whose rows carry no block_size (512 for the "
                         "FAST'25 traces); records and exported traces carry their own, which it must match")
    rp.add_argument("--vocab-size", type=_count(101), default=4096, metavar="N",
                    help="synthesized token ids are below this, and from 100 up (default %(default)s)")
    rp.add_argument("--max-concurrency", type=_count(1), default=256, metavar="N",
                    help="requests in flight at most; later arrivals wait (default %(default)s)")
    rp.add_argument("--timeout", type=_above_zero, default=600.0, metavar="S",
                    help="seconds a request may wait for any one read (default %(default)s)")
    rp.add_argument("--report", default=None, metavar="PATH", help="write an HTML report with plots there")
    rp.add_argument("--ca-file", default=None, metavar="PATH", help="CA bundle to verify an https:// frontend")
    rp.add_argument("--insecure", action="store_true", help="do not verify an https:// frontend's certificate")
    rp.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _count(least: int):
    def parse(value: str) -> int:
        if not value.isdigit() or int(value) < least:
            raise argparse.ArgumentTypeError(f"must be an integer of at least {least}, not {value}")
        return int(value)

    return parse


def _above_zero(value: str) -> float:
    number = float(value)
    if not number > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, not {value}")
    return number


def cmd_replay(args: argparse.Namespace) -> int:
    """Replay, print the summary; 0 when no request failed (a replayed
    client disconnect is no failure), 1 when any failed, 2 on unusable input or report."""
    import anyio
    from tqdm import tqdm

    from . import replay

    try:
        work = replay.load_rows(args.files, args.block_size)
    except ValueError as exc:
        print(f"asgi-generate-trace: {exc}", file=sys.stderr)
        return 2
    rows, block_size, skipped = work.rows, work.block_size, work.skipped
    print(f"replaying {len(rows)} requests (block_size {block_size}, {skipped} record"
          f"{'' if skipped == 1 else 's'} skipped) against {args.url}, speedup {args.speedup:g}", file=sys.stderr)
    bar = tqdm(total=len(rows), unit="req", disable=args.no_progress, file=sys.stderr)
    failed = 0

    def progress(result: "replay.Result") -> None:
        nonlocal failed
        failed += result.error is not None
        bar.update(1)
        bar.set_postfix(errors=failed, refresh=False)

    verify = False if args.insecure else (args.ca_file or True)
    with bar:
        results, wall = anyio.run(lambda: replay.replay(
            rows, block_size, args.url, fmt=args.format, speedup=args.speedup, max_concurrency=args.max_concurrency,
            timeout=args.timeout, vocab_size=args.vocab_size, verify=verify, progress=progress))
    text = replay.summary(results, rows, wall, work.recorded)
    print(text)
    if args.report:
        from ...exceptions import ReportUnavailable
        from .report import write_report

        parameters = [
            ("files", ", ".join(args.files)), ("url", args.url), ("format", args.format),
            ("speedup", f"{args.speedup:g}"), ("block size", str(block_size)),
            ("input", "request_end records" if work.recorded is not None else "Mooncake trace"),
            ("requests", f"{len(rows)} ({skipped} records skipped)"), ("vocab size", str(args.vocab_size)),
            ("max concurrency", str(args.max_concurrency)), ("timeout", f"{args.timeout:g} s"),
        ]
        try:
            write_report(args.report, f"asgi-generate replay of {', '.join(args.files)}", parameters, text, results)
        except (ReportUnavailable, OSError) as exc:
            print(f"asgi-generate-trace: {exc}", file=sys.stderr)
            return 2
    return 1 if any(r.error is not None for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
