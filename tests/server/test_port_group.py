"""Listening sockets for ``serve --workers N``: one per process on Linux
(``SO_REUSEPORT``), or one shared; a port in use stays refused."""

from __future__ import annotations

import socket

import pytest

from asgi_generate.server.serving import REUSE_PORT, listening_socket, port_group

pytestmark = pytest.mark.skipif(not REUSE_PORT, reason="SO_REUSEPORT spreads connections on Linux only")


def test_a_reusable_socket_gets_siblings_on_its_address_a_plain_one_is_shared():
    sock = listening_socket("127.0.0.1", 0, reuse_port=True)
    group = port_group(sock, 3)
    try:
        assert group[0] is sock and len({s.fileno() for s in group}) == 3
        assert {s.getsockname() for s in group} == {sock.getsockname()}
        assert all(s.get_inheritable() for s in group)
    finally:
        for s in group:
            s.close()
    plain = listening_socket("127.0.0.1", 0)
    try:
        assert port_group(plain, 3) == [plain] * 3
    finally:
        plain.close()


@pytest.mark.parametrize("taken_reusable", [False, True])
def test_a_port_in_use_is_refused_even_to_a_reusable_socket(taken_reusable):
    """The option lets this server's own processes share the port, never a
    second server (checked by binding without the option first)."""
    taken = listening_socket("127.0.0.1", 0, reuse_port=taken_reusable)
    try:
        with pytest.raises(OSError) as err:
            listening_socket("127.0.0.1", taken.getsockname()[1], reuse_port=True)
        assert err.value.strerror == "Address already in use"
    finally:
        taken.close()


def test_every_socket_of_a_group_takes_connections():
    sock = listening_socket("127.0.0.1", 0, reuse_port=True)
    group = port_group(sock, 2)
    clients = []
    try:
        for s in group:
            s.settimeout(0)
        for _ in range(64):  # each from its own source port: the kernel's hash spreads them
            clients.append(socket.create_connection(sock.getsockname(), timeout=5))
        taken = []
        for s in group:
            n = 0
            while True:
                try:
                    s.accept()[0].close()
                except BlockingIOError:
                    break
                n += 1
            taken.append(n)
        assert sum(taken) == 64 and min(taken) >= 12, taken
    finally:
        for c in clients:
            c.close()
        for s in group:
            s.close()
