"""The trace writer's work per record in CPU instructions (callgrind).

Other load on a shared machine moves timings by tens of percent, never an
instruction count. For each record shape of ``bench_tracing.py`` (128 and
16384 input tokens, 32 output tokens; tracing ``on``, and ``parsers``: the
bundled tokenizer with the qwen3 reasoning and hermes tool-call parsers) this
runs ``write_records`` (build, serialize, write, in batches of 16) in a child
under ``valgrind --tool=callgrind`` twice, for ``--records`` and for none,
and prints the difference per record: the process start, imports and setup
cancel out. ``--part hashes`` counts only the replay block hashes (as the
record makes them: JSON text, :func:`block_hashes_json`) of the
same prompts, ``--part dumps`` only ``orjson.dumps`` of built records.

Usage: ``.venv/bin/python bench/bench_trace_instructions.py [--records 160]``
(a few minutes; needs valgrind on PATH). Linux only.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
SIZES = (128, 16384)
MODES = ("on", "parsers")
PARTS = ("record", "hashes", "dumps")


def child(size: int, mode: str, part: str, records: int) -> None:
    """The measured work, run under callgrind (``--child``)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import orjson

    from bench_tracing import trace_states, write_records

    from asgi_generate.assets import TOKENIZER_PATH
    from asgi_generate.tracing.analysis import OutputAnalyzer
    from asgi_generate.tracing.hashing import block_hashes_json
    from asgi_generate.tracing.record import build_record
    from asgi_generate.tracing.sinks import JsonlFileSink

    analyzer = OutputAnalyzer(str(TOKENIZER_PATH), "qwen3", "hermes") if mode == "parsers" else None
    states = trace_states(size)
    built = [build_record(st, 64, analyzer) for st in states]
    sink = JsonlFileSink(os.path.join(tempfile.mkdtemp(prefix="bench-instr-"), "t.jsonl"), 0)
    sink.open()
    write_records(states, analyzer, sink, 1)  # warm: first-call caches, file opened
    rounds = records // len(states)
    if part == "record":
        write_records(states, analyzer, sink, rounds)
    elif part == "hashes":
        for _ in range(rounds):
            for st in states:
                block_hashes_json(st.input_ids, 64)
    else:
        for _ in range(rounds):
            for rec in built:
                orjson.dumps(rec)
    sink.close()


def collected(size: int, mode: str, part: str, records: int) -> int:
    """Instructions callgrind counted in one child run."""
    cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, __file__,
           "--child", str(size), mode, part, str(records)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "0"}).stderr
    return int(re.search(r"Collected : (\d+)", out).group(1))


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=160, help="records measured per cell, a multiple of 16")
    parser.add_argument("--part", choices=PARTS, nargs="*", default=list(PARTS), help="what to count")
    args = parser.parse_args()
    print(f"# trace writer instructions per record (callgrind), {args.records} records per cell, "
          f"block size 64, 32 output tokens\n")
    print("| input tokens | mode | part | instructions per record |")
    print("|---|---|---|---:|")
    for size in SIZES:
        for mode in MODES:
            for part in args.part:
                if part != "record" and mode == "parsers":
                    continue  # hashes and dumps do not depend on the parsers
                n = (collected(size, mode, part, args.records) - collected(size, mode, part, 0)) / args.records
                print(f"| {size} | {mode} | {part} | {n:,.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
