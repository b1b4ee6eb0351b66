"""The migration SIGKILL campaign at full size: 1,000 streams (500 SGLang,
500 vLLM; unary and SSE mixed, some with logprobs) over three simulator
processes per protocol with timing on (TTFT = ITL = 5 ms); two simulators
SIGKILLed at random moments and restarted on their ports. Every answer must
equal the uninterrupted one, every record be exact, and no simulator be
running anything at the end (see ``tests/migration_campaign.py``).

Usage: ``.venv/bin/python bench/bench_migration_campaign.py [--streams 1000] [--seed 1]``.
Exit status 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import migration_campaign  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=1000, help="requests over both protocols (default %(default)s)")
    parser.add_argument("--kills", type=int, default=2, help="SIGKILLs per protocol (default %(default)s)")
    parser.add_argument("--concurrency", type=int, default=32, help="connections (default %(default)s)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench-migration-campaign-"))
    failed = False
    print("| protocol | requests | kills (s, simulator) | migrations | replays | seconds | mismatches |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for i, protocol in enumerate(("sglang", "vllm")):
        out = migration_campaign.run(protocol, args.streams // 2, args.kills, tmp,
                                     concurrency=args.concurrency, seed=args.seed + i)
        print(f"| {protocol} | {out.requests} | {out.kills} | {out.migrations} | {out.replays} | "
              f"{out.seconds:.1f} | {len(out.mismatches)} |")
        for m in out.mismatches[:20]:
            print("  ", m)
        failed = failed or bool(out.mismatches)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
