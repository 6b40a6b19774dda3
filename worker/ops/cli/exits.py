"""How a command ends: its exit statuses, and a long-running command stopped by SIGTERM or SIGINT
(drained once it serves; at once, as ``Interrupted``, while it is still starting)."""

from __future__ import annotations

import asyncio
import enum
import signal
from collections.abc import Awaitable, Callable


class Exit(enum.IntEnum):
    """The ``worker`` command's exit statuses (docs/cli.md lists them)."""

    OK = 0
    FAILED = 1
    """A check found a failure (``verify``, ``health``), an ``outbox retry`` or ``outbox cancel``
    could not act on some id it was given (the others done), or the command crashed: an
    unexpected error, logged at CRITICAL with its traceback."""
    USAGE = 2
    """A usage or configuration error, a refused login among them: one sentence that names the
    setting to fix."""
    UNREACHABLE = 3
    """PostgreSQL or RabbitMQ could not be reached (after the start-up retries of a long-running
    command): one sentence naming the service, its URL (redacted) and the setting to fix."""
    BROKEN_PIPE = 128 + signal.SIGPIPE
    """The reader of the output went away (``worker status | head -4``): nothing more is said,
    as a command killed by SIGPIPE, whose status a shell shows as 141."""


class Interrupted(Exception):
    """SIGTERM or SIGINT arrived before the command started serving: it stops at once, with
    ``128 + signal``, the status a shell shows for a process killed by that signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


async def until_signalled(
    serve: Callable[[asyncio.Event, asyncio.Event], Awaitable[object]],
) -> None:
    """Run ``serve(stop, started)`` until SIGTERM or SIGINT sets ``stop``.

    Before ``serve`` sets ``started`` (while it connects, retrying PostgreSQL or RabbitMQ for up
    to a minute), a signal cancels it instead, and ``Interrupted`` is raised once what it opened
    is closed: nothing was consuming or serving yet, so there is nothing to drain.
    """
    stop, started = asyncio.Event(), asyncio.Event()
    serving = asyncio.current_task()
    assert serving is not None
    received: list[int] = []

    def on_signal(signum: int) -> None:
        received.append(signum)
        stop.set()
        if not started.is_set() and len(received) == 1:
            serving.cancel()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        await serve(stop, started)
    except asyncio.CancelledError:
        if received and not started.is_set():
            raise Interrupted(received[0]) from None
        raise
