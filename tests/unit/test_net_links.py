"""elastic_train.net's connection cut: what a broken group's shutdown and the agent's cut rely on."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from elastic_train import net

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")


def test_a_cut_fails_a_receive_blocked_on_a_recorded_connection() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    try:
        (client, peer), links = net.opened_by(
            lambda: (socket.create_connection(server.getsockname()), server.accept()[0])
        )
        assert set(links) == {client.fileno(), peer.fileno()}  # the listener is left out
        got: list[bytes] = []
        reader = threading.Thread(target=lambda: got.append(client.recv(10)))
        reader.start()
        net.add_extra_links(server, {client.fileno(): links[client.fileno()]})
        assert net.cut_extra_links() == 1
        reader.join(5)
        assert not reader.is_alive() and got == [b""]  # the blocked receive returned at once
        net.drop_extra_links(server)
        assert net.cut_extra_links() == 0
        client.close(), peer.close()
    finally:
        server.close()


def test_a_descriptor_reused_by_another_connection_is_not_cut() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    try:
        first, links = net.opened_by(lambda: socket.create_connection(server.getsockname()))
        fd = first.fileno()
        first.close()
        other = socket.create_connection(server.getsockname())  # may take the same descriptor
        assert net.shut_down({fd: links[fd]}) == 0
        other.sendall(b"x")  # still connected
        other.close()
    finally:
        server.close()
