"""Minted request ids."""

from __future__ import annotations

import os

import pytest

from asgi_generate.sdk import _ids as ids


def test_minted_ids_are_fixed_width_and_never_prefixes():
    got = [ids.mint() for _ in range(1000)]
    assert {len(i) for i in got} == {32}
    assert len(set(got)) == 1000
    assert not any(a != b and b.startswith(a) for a in got[:50] for b in got)


@pytest.mark.e2e  # it forks
def test_a_process_forked_after_import_mints_ids_of_its_own():
    # A pre-forking server (or a fork server) forks after the import: its
    # children share one engine with their parent and each other, and an
    # abort of one id would end another's request.
    ids.mint()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its first two ids, then exit at once
        os.write(write, f"{ids.mint()} {ids.mint()}".encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        first, second = pipe.read().split()
    assert os.waitpid(pid, 0)[1] == 0
    ours = ids.mint()
    assert first[:16] != ours[:16] and second[:16] == first[:16]
    assert (first[16:], second[16:]) == (f"{1:016x}", f"{2:016x}")
