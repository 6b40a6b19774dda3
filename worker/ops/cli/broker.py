"""A broker connection for one command: retried while the broker starts, closed afterwards."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from aio_pika.abc import AbstractRobustConnection

from worker.settings import Settings

_T = TypeVar("_T")


async def with_broker(
    settings: Settings,
    action: Callable[[AbstractRobustConnection], Awaitable[_T]],
    *,
    name: str = "worker-dlq",
) -> _T:
    """``action`` on a broker connection named ``name``, retried while the broker starts, closed
    afterwards."""
    from worker.ops.runner import connect_broker

    connection = await connect_broker(settings, name=name)
    try:
        return await action(connection)
    finally:
        await connection.close()
