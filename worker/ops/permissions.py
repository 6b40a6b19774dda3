"""The broker permissions of least-privilege users, as the regular expressions RabbitMQ matches
against resource names (configure, write, read; see ``deploy/rabbitmq/definitions.json``).

The invariant: a producer can publish to the events exchange and nothing else, so it cannot
forge a "parked" message through ``<queue>.dlx``, nor pick a queue (and so a handler, or a retry
queue) through the default exchange, whose resource name is ``amq.default``. The worker may
configure, write and read its own names only: the events exchange, its queue, ``<queue>.dlx``,
``<queue>.dlq`` and the ``<queue>.retry.*`` queues; it also writes to ``amq.default``, through
which it sends delayed retries and DLQ replays.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from worker.settings import Settings

DEFAULT_EXCHANGE = "amq.default"
"""The resource whose write permission publishing to the default exchange needs."""

NOTHING = "^$"
"""A pattern no resource name matches."""


@dataclass(frozen=True)
class Permissions:
    """One user's permissions in one virtual host: a pattern per kind of access."""

    configure: str
    write: str
    read: str


def _any_of(*patterns: str) -> str:
    return f"^({'|'.join(patterns)})$"


def _worker_names(settings: Settings) -> list[str]:
    """Patterns of every exchange and queue the worker declares."""
    return [
        re.escape(settings.exchange),
        re.escape(settings.queue),
        re.escape(settings.dead_letter_exchange),
        re.escape(settings.dead_letter_queue),
        re.escape(f"{settings.queue}.retry.") + ".+",
    ]


def worker_permissions(settings: Settings) -> Permissions:
    """What ``worker run``, ``worker relay`` and ``worker dlq`` need, and no more."""
    own = _any_of(*_worker_names(settings))
    return Permissions(
        configure=own,
        write=_any_of(*_worker_names(settings), re.escape(DEFAULT_EXCHANGE)),
        read=own,
    )


def producer_permissions(settings: Settings) -> Permissions:
    """Publish to the events exchange; declare nothing, read nothing."""
    return Permissions(configure=NOTHING, write=_any_of(re.escape(settings.exchange)), read=NOTHING)
