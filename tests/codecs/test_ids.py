"""Minted request ids."""

from __future__ import annotations

from asgi_generate.sdk import ids


def test_minted_ids_are_fixed_width_and_never_prefixes():
    got = [ids.mint() for _ in range(1000)]
    assert {len(i) for i in got} == {32}
    assert len(set(got)) == 1000
    assert not any(a != b and b.startswith(a) for a in got[:50] for b in got)
