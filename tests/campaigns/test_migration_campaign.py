"""The migration SIGKILL campaign, scaled down (``migration_campaign``;
the 1,000-stream run is ``bench/bench_migration_campaign.py``): 150 streams
per protocol over three simulators with timing on, one SIGKILLed and
restarted mid-run; every answer exact, every record exact, nothing left
running."""

from __future__ import annotations

import pytest

import migration_campaign

# A campaign's run time grows with the machine's load: a hang guard, not a verdict.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_sigkill_campaign_scaled_down(protocol, tmp_path):
    out = migration_campaign.run(protocol, 150, 1, tmp_path, concurrency=24, seed=3)
    assert out.mismatches == []
    assert len(out.kills) == 1
