"""``worker.liveness``: the socket options and server settings that make a silent connection
fail within seconds, read back from real sockets."""

from __future__ import annotations

import socket

import pytest
from yarl import URL

from worker.database import unreachable
from worker.liveness import Liveness
from worker.settings import Settings
from worker.transport.connection import _Connection, _LiveTransports

LIVENESS = Liveness(keepalive_idle=5, user_timeout=10, connect_timeout=5, heartbeat=10)


@pytest.mark.skipif(not hasattr(socket, "TCP_USER_TIMEOUT"), reason="Linux's TCP options")
def test_a_tcp_socket_gets_keepalive_and_a_user_timeout() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        LIVENESS.configure(sock)

        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 5
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 2
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 5
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 10_000


def test_zero_leaves_the_operating_system_defaults() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        Liveness(keepalive_idle=0, user_timeout=0, connect_timeout=5, heartbeat=10).configure(sock)

        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 0


def test_a_unix_socket_or_none_is_left_alone() -> None:
    left, right = socket.socketpair(socket.AF_UNIX)
    with left, right:
        LIVENESS.configure(left)
        LIVENESS.configure(None)

        assert left.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 0


def test_postgresql_is_asked_for_the_same_bounds_on_its_end() -> None:
    assert LIVENESS.server_settings() == {
        "tcp_keepalives_idle": "5",
        "tcp_keepalives_interval": "2",
        "tcp_keepalives_count": "5",
        "tcp_user_timeout": "10000",
    }
    assert Liveness(0, 0, 5, 10).server_settings() == {}


def test_the_settings_choose_them() -> None:
    settings = Settings.load(
        {"WORKER_TCP_KEEPALIVE_IDLE": "3s", "WORKER_TCP_USER_TIMEOUT": "20s"},
        broker_heartbeat=7,
    )

    assert Liveness.of(settings) == Liveness(3.0, 20.0, 5.0, 7)


async def test_a_broker_url_asks_for_the_chosen_heartbeat_unless_it_sets_its_own() -> None:
    connection = _Connection(
        ["amqp://guest:guest@127.0.0.1:1/", "amqp://guest:guest@127.0.0.1:2/?heartbeat=30"],
        "test",
        LIVENESS,
    )
    try:
        assert connection.url.query["heartbeat"] == "10"
        connection._next_node()
        assert connection.url == URL("amqp://guest:guest@127.0.0.1:2/?heartbeat=30")
    finally:
        await connection.close()


async def test_a_broker_connection_opens_its_sockets_with_the_liveness_options() -> None:
    connection = _Connection(["amqp://guest:guest@127.0.0.1:1/"], "test", LIVENESS)
    try:
        factory = connection.kwargs["transport_factory"]
        assert isinstance(factory, _LiveTransports)
        assert factory._liveness == LIVENESS
    finally:
        await connection.close()


def test_a_pause_says_why_postgresql_counts_as_unreachable() -> None:
    assert unreachable(TimeoutError()) == "PostgreSQL unreachable: no answer in 5 s"
    refused = unreachable(ConnectionRefusedError(111, "Connect call failed"))
    assert (
        refused == "PostgreSQL unreachable: ConnectionRefusedError: [Errno 111] Connect call failed"
    )
