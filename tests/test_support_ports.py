"""The test ports (tests/support.py ``free_port``): each test process's
share of the ports outside the kernel's ephemeral range."""

from __future__ import annotations

from support import port_share


def test_the_share_is_below_the_ephemeral_range_split_between_the_test_processes():
    shares = [list(port_share(32768, 60999, 2, worker, pid=6145)) for worker in (0, 1)]
    assert [(len(s), min(s), max(s), s[0]) for s in shares] == [(6144, 20480, 26623, 20481),
                                                               (6144, 26624, 32767, 26625)]


def test_a_range_from_1024_up_leaves_the_ports_above_it():
    """``ip_local_port_range`` ``1024 65000`` leaves nothing below it: the
    share is taken above it (it divided by zero)."""
    shares = [list(port_share(1024, 65000, 2, worker, pid=3)) for worker in (0, 1)]
    assert [(len(s), min(s), max(s), s[0]) for s in shares] == [(267, 65001, 65267, 65004),
                                                               (267, 65268, 65534, 65271)]
