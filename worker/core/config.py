"""What a unit of work needs to know of its deployment, in one small record: the hot path reads
this, never the worker's settings, so it runs the same under the consumer and the test harness.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from worker.backoff import bound_from_now
from worker.core.contention import Contention


@dataclass(frozen=True)
class UnitOfWorkConfig:
    """How units of work publish and hold workflows.

    ``exchange`` is where ``ctx.publish`` sends an event that names none; with ``notify``, a
    transaction that appends outbox rows sends one NOTIFY to listening relays at its commit, and
    ``on_events`` (a relay's wake-up, in the same process) is called after that commit;
    ``workflow_lease`` is how long, in seconds, a workflow's owner holds it between steps;
    ``contention`` which handlers' batches take turns (share one between a process's consumers);
    ``database_timeout`` how long, in seconds, each of the unit of work's own steps (its claim,
    its end and commit) may wait on PostgreSQL (None: as long as it takes).
    """

    exchange: str
    notify: bool = False
    on_events: Callable[[], None] | None = None
    workflow_lease: float = 30.0
    contention: Contention = field(default_factory=Contention, compare=False)
    database_timeout: float | None = None

    def bound(self, deadline: asyncio.Timeout) -> None:
        """Give the unit of work's own next step ``database_timeout`` seconds from now."""
        bound_from_now(deadline, self.database_timeout)

    def committed_events(self) -> None:
        """Tell the in-process relay that a commit added outbox rows."""
        if self.on_events is not None:
            self.on_events()
