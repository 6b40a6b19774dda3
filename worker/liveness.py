"""How soon a silent connection counts as dead: TCP keepalive and TCP_USER_TIMEOUT on every
socket the worker opens to PostgreSQL or RabbitMQ, and the same asked of PostgreSQL's end.

Invariant: a connection whose network path has gone silent (a firewall, security group or NAT
entry that drops packets instead of refusing them) fails within about ``tcp_user_timeout``
seconds, whether the worker was waiting for an answer (sent data unacknowledged) or idle
(keepalive probes unanswered), instead of waiting out TCP's retransmissions (about 15 min on
Linux). A live connection is never cut, however long its query runs: the peer's kernel answers
the probes. The server's end is told the same (``server_settings``), so a backend whose client
vanished ends, rolling back its transaction and releasing its locks, within the same bound.
"""

from __future__ import annotations

import functools
import math
import socket
from dataclasses import dataclass

from worker.settings import Settings

KEEPALIVE_INTERVAL = 2.0
"""Seconds between two keepalive probes once a connection has been idle ``keepalive_idle``."""


@dataclass(frozen=True)
class Liveness:
    """The settings that say when a silent connection is dead (see ``worker.settings``); 0 for
    either TCP value leaves the operating system's default."""

    keepalive_idle: float
    user_timeout: float
    connect_timeout: float
    heartbeat: int

    @classmethod
    def of(cls, settings: Settings) -> Liveness:
        return cls(
            keepalive_idle=settings.tcp_keepalive_idle,
            user_timeout=settings.tcp_user_timeout,
            connect_timeout=settings.database_connect_timeout,
            heartbeat=settings.broker_heartbeat,
        )

    @classmethod
    @functools.cache
    def default(cls) -> Liveness:
        """The settings' defaults, for a connection made without settings at hand."""
        return cls.of(Settings())

    @property
    def keepalive_count(self) -> int:
        """Unanswered probes before the connection is dropped: as many as fit in
        ``user_timeout`` (at least one), so both bounds agree."""
        return max(1, math.ceil(self.user_timeout / KEEPALIVE_INTERVAL))

    def configure(self, sock: socket.socket | None) -> None:
        """Set keepalive and the user timeout on ``sock`` (a TCP socket; a Unix socket, or
        none, is left alone), each option only where the platform has it."""
        if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
            return
        if self.keepalive_idle > 0:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            for name, value in (
                ("TCP_KEEPIDLE", self.keepalive_idle),
                ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL),
                ("TCP_KEEPCNT", self.keepalive_count),
            ):
                _set(sock, name, max(1, math.ceil(value)))
        if self.user_timeout > 0:
            _set(sock, "TCP_USER_TIMEOUT", round(self.user_timeout * 1000))

    def server_settings(self) -> dict[str, str]:
        """PostgreSQL's settings that give its end of the connection the same bounds (ignored
        by the server on a Unix socket)."""
        settings: dict[str, str] = {}
        if self.keepalive_idle > 0:
            settings["tcp_keepalives_idle"] = str(max(1, math.ceil(self.keepalive_idle)))
            settings["tcp_keepalives_interval"] = str(math.ceil(KEEPALIVE_INTERVAL))
            settings["tcp_keepalives_count"] = str(self.keepalive_count)
        if self.user_timeout > 0:
            settings["tcp_user_timeout"] = str(round(self.user_timeout * 1000))
        return settings


def _set(sock: socket.socket, name: str, value: int) -> None:
    """``setsockopt(IPPROTO_TCP, name, value)`` if this platform defines ``name``."""
    option = getattr(socket, name, None)
    if option is not None:
        sock.setsockopt(socket.IPPROTO_TCP, option, value)
