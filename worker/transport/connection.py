"""Opening a broker connection so that a failed attempt leaves nothing behind.

aio-pika closes a connection object that is garbage-collected unclosed by scheduling
``close()`` on the current event loop from ``__del__``; when the collector runs in another
thread (``asyncio.to_thread``, a signal handler's thread) there is no loop there, and the close
coroutine is dropped unawaited. A first connect that fails (the broker still starting, a wrong
password, a missing virtual host) returned such an object to nobody. ``connect`` closes it at
once instead, so every connection the worker ever created is closed by the worker.
"""

from __future__ import annotations

import contextlib

import aio_pika
from aio_pika.abc import AbstractRobustConnection, TimeoutType


class _Connection(aio_pika.RobustConnection):
    """A robust connection that closes itself when connecting fails."""

    async def connect(self, timeout: TimeoutType = None) -> None:  # noqa: ASYNC109 (aio-pika's)
        try:
            await super().connect(timeout)
        except BaseException:
            with contextlib.suppress(Exception):
                await self.close()
            raise


async def connect(
    url: str, *, name: str = "worker", within: float | None = None
) -> AbstractRobustConnection:
    """One attempt at a robust connection to ``url``, named ``name`` in the broker's UI, given up
    after ``within`` seconds if given.

    Once open, it reconnects by itself after a loss; if this first attempt fails, the error is
    raised and the half-made connection is already closed.
    """
    connection: AbstractRobustConnection = await aio_pika.connect_robust(
        url,
        timeout=within,
        client_properties={"connection_name": name},
        connection_class=_Connection,
    )
    return connection
