"""Opening a broker connection to one node of several, so that a failed attempt leaves nothing
behind and a lost node is left for the next one.

``amqp_url`` may name several nodes of one cluster (``worker.settings.broker_urls``). The first
connect tries them in order and keeps the first that answers. Once open, the connection is
aio-pika's robust connection, which reconnects by itself after a loss, always to its ``url``;
here every lost connection and every failed attempt moves ``url`` on to the next node (round
robin), so a reconnect goes to a node that may be alive instead of retrying a dead one for ever.
(aio-pika calls ``_on_connection_close`` in both cases, a failed attempt included, and reads
``url`` afresh for each attempt: that is the seam.) The URL's own options (TLS files, heartbeat)
are read from the node's URL at each attempt; aio-pika's own (``reconnect_interval``) from the
URL of the node it first connected to.

What a reconnect does to deliveries: their channel died with the old connection, so their tags
are void; ``worker.transport.acks`` never sends their acks on the new one, the broker redelivers
them, and the inbox recognises what was committed as a duplicate.

aio-pika closes a connection object that is garbage-collected unclosed by scheduling
``close()`` on the current event loop from ``__del__``; when the collector runs in another
thread (``asyncio.to_thread``, a signal handler's thread) there is no loop there, and the close
coroutine is dropped unawaited. A first connect that fails (the broker still starting, a wrong
password, a missing virtual host) returned such an object to nobody. ``connect`` closes it at
once instead, so every connection the worker ever created is closed by the worker.

A silent network path (packets dropped, no reset) is noticed within seconds, not after TCP's
retransmissions: every connection asks for the AMQP heartbeat the settings choose (unless its
URL sets one), and its socket gets TCP keepalive and TCP_USER_TIMEOUT (``worker.liveness``), so
a heartbeat left unacknowledged fails the connection and the robust connection reconnects.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

import aio_pika
from aio_pika.abc import TimeoutType
from aiormq.connection import TCPTransportFactory, TLSTransportFactory, TransportFactory
from yarl import URL

from worker.liveness import Liveness
from worker.settings import broker_urls, redact

log = logging.getLogger(__name__)


class _Connection(aio_pika.RobustConnection):
    """A robust connection over the nodes ``urls`` (tried from the first), named ``name``: it
    closes itself when connecting fails, and each time a connection is lost or an attempt fails,
    the next attempt goes to the next node. A lost connection and a reconnect are logged."""

    def __init__(self, urls: Sequence[str], name: str, liveness: Liveness) -> None:
        self._nodes = tuple(_with_heartbeat(URL(url), liveness.heartbeat) for url in urls)
        self._node = 0
        self._name = name
        super().__init__(self._nodes[0], client_properties={"connection_name": name})
        # (aio-pika keeps only the keyword arguments it knows; aiormq's it passes on from here)
        self.kwargs["transport_factory"] = _LiveTransports(liveness)

    async def connect(self, timeout: TimeoutType = None) -> None:  # noqa: ASYNC109 (aio-pika's)
        try:
            await super().connect(timeout)
        except BaseException:
            with contextlib.suppress(Exception):
                await self.close()
            raise

    async def _on_connection_close(self, closing: asyncio.Future[Any]) -> None:
        reconnects = not self._close_called  # (closed by its owner: ``url`` stays)
        lost, node = self.connected.is_set() and reconnects, self.url  # (else an attempt failed)
        try:
            await super()._on_connection_close(closing)
        finally:
            if reconnects:
                self._next_node()
        if lost:
            log.warning(
                "broker connection %r to %s lost (%s); reconnecting to %s",
                self._name,
                redact(str(node)),
                _reason(closing),
                redact(str(self.url)),
            )

    async def _on_connected(self) -> None:
        reconnect = self.connection_attempt > 0
        await super()._on_connected()  # (restores the channels, then calls reconnect_callbacks)
        if reconnect:
            log.info("broker connection %r reconnected to %s", self._name, redact(str(self.url)))

    def _next_node(self) -> None:
        """Point the next attempt at the next node, round robin."""
        self._node = (self._node + 1) % len(self._nodes)
        self.url = self._nodes[self._node]


class _LiveTransports(TransportFactory):
    """aiormq's transports (TLS for ``amqps://``), each socket given ``liveness``'s keepalive
    and user timeout as soon as it is connected."""

    def __init__(self, liveness: Liveness) -> None:
        self._liveness = liveness

    async def create(
        self, url: URL, **kwargs: Any
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        plain = TLSTransportFactory() if url.scheme == "amqps" else TCPTransportFactory()
        reader, writer = await plain.create(url, **kwargs)
        self._liveness.configure(writer.get_extra_info("socket"))
        return reader, writer


def _with_heartbeat(url: URL, heartbeat: int) -> URL:
    """``url`` asking for ``heartbeat`` seconds, unless it asks for a heartbeat of its own."""
    return url if "heartbeat" in url.query else url.update_query(heartbeat=str(heartbeat))


def _reason(closing: asyncio.Future[Any]) -> str:
    """Why a connection closed, from the future aio-pika hands its close callbacks."""
    if closing.cancelled():
        return "closed"
    error = closing.exception()
    return repr(error) if error is not None else "closed"


async def connect(
    url: str | Sequence[str],
    *,
    name: str = "worker",
    within: float | None = None,
    liveness: Liveness | None = None,
) -> aio_pika.RobustConnection:
    """A robust connection to the first node of ``url`` that answers (one URL, several
    separated by commas, or a sequence of them), named ``name`` in the broker's UI; each node is
    given up after ``within`` seconds if given. Its ``url`` is the node it is connected to (or
    will try next, while it reconnects). ``liveness`` (default: the settings' defaults) says how
    soon a silent connection counts as lost.

    Once open, it reconnects by itself after a loss, to the next node. If no node answers, the
    last node's error is raised, and every half-made connection is already closed.
    """
    urls = broker_urls(url) if isinstance(url, str) else tuple(url)
    if not urls:
        raise ValueError("no broker URL to connect to")
    live = liveness or Liveness.default()
    for first in range(len(urls) - 1):
        try:
            return await _open(urls[first:] + urls[:first], name, within, live)
        except Exception as exc:
            log.warning(
                "cannot connect to RabbitMQ at %s (%r); trying %s",
                redact(urls[first]),
                exc,
                redact(urls[first + 1]),
            )
    return await _open(urls[-1:] + urls[:-1], name, within, live)


class Observing:
    """A broker connection of its own for what only observes (the sampler's queue counts), made
    at first use, one at most, reconnecting by itself once open, closed by ``close``.

    Invariant: an observer never opens or closes a channel on a connection that carries work. A
    timeout that cancels a channel's open or close halfway leaves the broker and the client at
    odds about that channel number, and the broker then closes the whole connection
    (``CHANNEL_ERROR - expected 'channel.open'``): here that costs an observer a reconnect, not
    the consumer's or the relay's deliveries.
    """

    def __init__(self, url: str | Sequence[str], name: str, liveness: Liveness) -> None:
        self._url = url
        self._name = name
        self._liveness = liveness
        self._connection: aio_pika.RobustConnection | None = None
        self._opening = asyncio.Lock()
        self._closed = False

    async def get(self, within: float | None = None) -> aio_pika.RobustConnection:
        """The connection, opened now (each node given ``within`` seconds) if it is not yet."""
        async with self._opening:
            if self._closed:
                raise ConnectionError(f"the {self._name!r} connection is closed")
            if self._connection is None:
                self._connection = await connect(
                    self._url, name=self._name, within=within, liveness=self._liveness
                )
            return self._connection

    async def close(self) -> None:
        """Close the connection if one was made; ``get`` opens none after."""
        async with self._opening:
            self._closed = True
            connection, self._connection = self._connection, None
        if connection is not None:
            await connection.close()


async def _open(
    urls: Sequence[str], name: str, within: float | None, liveness: Liveness
) -> _Connection:
    """A robust connection over ``urls``, opened on the first of them."""
    connection = _Connection(urls, name, liveness)
    await connection.connect(timeout=within)
    return connection
