"""The trainer loop of the weight-update work at full size: 50 streams over
4 SGLang and 4 vLLM simulators with different tensor-parallel sizes, a pause
with abort, an update to a new weight version and a resume, with and without
--resume-after-pause, then one worker failing its update (see
``tests/trainer_loop.py``).

Usage: ``.venv/bin/python bench/bench_trainer_loop.py [--streams 50] [--worker-class trio]``.
Prints the seconds each phase took; exit status 1 on any problem.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import trainer_loop  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=50, help="streams over both protocols (default %(default)s)")
    parser.add_argument("--worker-class", choices=("trio", "asyncio"), default="trio")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        problems, figures = trainer_loop.run(tmp, args.worker_class, args.streams)
    print("| phase | figure |\n|---|---|")
    for name, value in figures.items():
        print(f"| {name} | {value} |")
    for p in problems:
        print("PROBLEM:", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
