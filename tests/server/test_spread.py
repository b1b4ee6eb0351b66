"""The table through which ``serve --workers N``'s processes even out their
keep-alive connections: counts shared by descriptor, one ask at a time."""

from __future__ import annotations

from asgi_generate.server import spread


def test_a_process_over_its_share_asks_one_connection_at_a_time():
    table = spread.Table.create(2)
    a, b = (spread.from_flag(table.argv(slot)[1]) for slot in (0, 1))  # as each child opens the inherited file
    for _ in range(18):
        a.opened()
    for _ in range(14):
        b.opened()
    assert not b.ask_to_close()
    assert a.ask_to_close()  # 18 of 32: over 16
    assert not a.ask_to_close()  # the asked one has not closed yet
    a.closed()
    b.opened()  # its client came back, to the other process: 17 / 15
    assert a.ask_to_close() and not b.ask_to_close()
    a.closed()
    b.opened()  # 16 / 16
    assert not a.ask_to_close() and not b.ask_to_close()
    a.opened()  # 17 of 33: the share rounds up
    assert not a.ask_to_close()


def test_a_gone_process_leaves_the_share_to_the_others():
    table = spread.Table.create(3)
    a, b = (spread.from_flag(table.argv(slot)[1]) for slot in (0, 1))
    for _ in range(10):
        a.opened()
        b.opened()
    assert a.ask_to_close()  # 10 of 20 over 3 processes: over 7
    a.closed()
    table.clear(2)  # the supervisor, once process 2 is gone: 9 and 10 over 2
    assert not a.ask_to_close() and not b.ask_to_close()
