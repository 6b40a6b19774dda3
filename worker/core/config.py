"""What a unit of work needs to know of its deployment, in one small record: the hot path reads
this, never the worker's settings, so it runs the same under the consumer and the test harness.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from worker.core.contention import Contention


@dataclass(frozen=True)
class UnitOfWorkConfig:
    """How units of work publish and hold workflows.

    ``exchange`` is where ``ctx.publish`` sends an event that names none; with ``notify``, a
    transaction that appends outbox rows sends one NOTIFY to listening relays at its commit, and
    ``on_events`` (a relay's wake-up, in the same process) is called after that commit;
    ``workflow_lease`` is how long, in seconds, a workflow's owner holds it between steps;
    ``contention`` which handlers' batches take turns (share one between a process's consumers).
    """

    exchange: str
    notify: bool = False
    on_events: Callable[[], None] | None = None
    workflow_lease: float = 30.0
    contention: Contention = field(default_factory=Contention, compare=False)

    def committed_events(self) -> None:
        """Tell the in-process relay that a commit added outbox rows."""
        if self.on_events is not None:
            self.on_events()
