"""The suite's campaigns at their full size.

The test suite runs each campaign at the smallest size that still catches
its bug class (``tests/support.py``'s ``campaign_size``); this runs the same
tests at the full size (``CAMPAIGN_SIZE=full``: not ``ASGI_GENERATE_*``, a
prefix the server keeps for its settings), one at a time, and prints each
one's outcome and wall time:

- ``test_rl_client``: 25 SGLang and 25 vLLM rollout streams (5 and 5 in the
  suite) through a pause, weight update and continue, 8 s first token;
- ``test_trace_campaign``: 500 mixed requests (100), one worker killed;
- ``test_routing_policies``' two frontend processes: 12 session keys (6);
- ``test_campaigns``' half-disconnected streams: 200 (100).

The migration campaign's full size has its own script,
``bench_migration_campaign.py``.

Usage: ``.venv/bin/python bench/bench_campaigns.py``.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
CAMPAIGNS = [
    "tests/campaigns/test_rl_client.py",
    "tests/campaigns/test_trace_campaign.py",
    "tests/workers/test_routing_policies.py::test_two_frontend_processes_agree_on_every_key",
    "tests/campaigns/test_campaigns.py::test_streams_half_disconnected",
]


def main() -> int:
    env = {**os.environ, "CAMPAIGN_SIZE": "full"}
    failed = 0
    print(f"{'campaign':<80} {'outcome':>8} {'seconds':>8}")
    for test in CAMPAIGNS:
        start = time.monotonic()
        # One process, no other test beside it: the figure is the campaign's.
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "--timeout", "600", test],
                              cwd=ROOT, env=env, capture_output=True, text=True)
        took = time.monotonic() - start
        outcome = "passed" if done.returncode == 0 else "FAILED"
        failed += done.returncode != 0
        print(f"{test:<80} {outcome:>8} {took:>8.1f}")
        if done.returncode:
            print(done.stdout[-4000:])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
