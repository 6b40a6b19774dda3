"""Multi-step workflows: ordered steps, each in its own transaction, resumable after a crash.

A workflow handler calls ``await wf.step(name, fn, *args)`` for each step. A step runs ``fn(ctx,
*args)`` in a transaction of its own that also stores the step's output, makes it the inbox row's
recovery point, appends the step's events to the outbox and renews the owner's lease; its
external calls happen before that commit and carry ``ctx.step_key`` (``<key>:<step>``), the same
on every re-run. A redelivery runs the handler again from the top, and every step that committed
returns its stored output instead of running: a committed step never runs twice.

Between steps the key is ``in_progress``, owned by one delivery (``owner``) until
``lease_until``. Another delivery takes it over only by compare-and-set when the lease expired
(its owner died) or was released (its owner failed); a live owner keeps it, and while a step's
transaction runs, its row lock keeps even an expired lease from being taken (``SKIP LOCKED``). A
delivery that finds the workflow owned raises ``WorkflowBusy``, a transient error: it is retried
later, never run beside the owner.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from worker.core.claims import claim, duplicate
from worker.core.codec import to_jsonable
from worker.core.config import UnitOfWorkConfig
from worker.core.connection import HandlerConnection
from worker.core.context import Context
from worker.core.envelope import Envelope
from worker.core.outcomes import Outcome
from worker.errors import Rejected, Retryable, handler_failed, is_transient
from worker.faults import crash_point
from worker.sql import inbox, outbox
from worker.sql.driver import in_transaction

log = logging.getLogger(__name__)

AFTER_STEP = "workflow.after_step:"
"""Crash point prefix: ``workflow.after_step:<step>`` is reached just after the step committed."""

BEFORE_COMMIT = "workflow.before_commit:"
"""Crash point prefix: ``workflow.before_commit:<step>`` is reached after the step's work (its
external call included), before its transaction commits."""


class WorkflowBusy(Retryable):
    """Another delivery owns this workflow and its lease is live; try again later."""


class Workflow:
    """A workflow handler's view of its run: ``step`` runs (or replays) one step."""

    def __init__(
        self,
        engine: AsyncEngine,
        envelope: Envelope,
        config: UnitOfWorkConfig,
        *,
        owner: str,
        outputs: dict[str, Any],
    ) -> None:
        self.engine = engine
        self.envelope = envelope
        self.config = config
        self.owner = owner
        self.outputs = dict(outputs)
        self._called: list[str] = []

    @property
    def key(self) -> str:
        """The idempotency key of the message that started the workflow."""
        return self.envelope.key

    @property
    def attempt(self) -> int:
        """1 on the message's first delivery, n + 1 after n delayed retries."""
        return self.envelope.delivery.attempt

    async def step(self, name: str, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Run ``fn(ctx, *args)`` as step ``name`` in its own transaction and return its output
        as stored (JSON); if the step committed in an earlier run, return that output unrun."""
        if name in self._called:
            raise ValueError(f"workflow step {name!r} is called twice")
        self._called.append(name)
        if name in self.outputs:
            log.debug("step %s of %s committed before; not run again", name, self.key)
            return self.outputs[name]
        handler = self.envelope.handler.name
        async with self.engine.connect() as conn, conn.begin():
            if not await inbox.hold_workflow(conn, handler, self.key, self.owner):
                raise WorkflowBusy(f"workflow {self.key!r} was taken over by another delivery")
            driver = await in_transaction(conn)
            ctx = Context(
                HandlerConnection(conn, driver),
                self.envelope,
                self.config.exchange,
                step=name,
                asyncpg=driver,
            )
            try:
                output = to_jsonable(await fn(ctx, *args))
                await ctx.flush()
                await outbox.append_outbox(conn, ctx.outbox, notify=self.config.notify)
                await inbox.record_step(
                    conn,
                    handler,
                    self.key,
                    step=name,
                    position=len(self._called),
                    output=output,
                    lease=self.config.workflow_lease,
                )
            finally:
                await ctx.close()
            crash_point(BEFORE_COMMIT + name)
        crash_point(AFTER_STEP + name)
        self.outputs[name] = output
        if ctx.outbox:
            self.config.committed_events()
        return output


async def run(engine: AsyncEngine, envelope: Envelope, config: UnitOfWorkConfig) -> Outcome:
    """Run (or resume) the envelope's workflow to its end and mark its key completed.

    Raises like ``unit_of_work.process``, plus ``WorkflowBusy`` when a live owner holds the
    workflow. After a failed try the workflow is released at once, so that the retry need not
    wait for the lease; its committed steps stay committed.
    """
    handler = envelope.handler
    owner = uuid.uuid4().hex
    lease = config.workflow_lease
    async with engine.connect() as conn, conn.begin():
        existing = await claim(conn, envelope, owner=owner, lease=lease)
        if existing is not None:
            if existing.status != "in_progress":
                return duplicate(existing)
            taken = await inbox.take_over_workflow(
                conn, handler.name, envelope.key, owner=owner, lease=lease
            )
            if not taken:
                raise WorkflowBusy(f"workflow {envelope.key!r} is running in another delivery")
        # a key claimed just now has no steps (they cascade with its inbox row)
        outputs = (
            {}
            if existing is None
            else await inbox.workflow_outputs(conn, handler.name, envelope.key)
        )
    if outputs:
        log.info(
            "resuming workflow %s of %s after %d steps", envelope.key, handler.name, len(outputs)
        )
    wf = Workflow(engine, envelope, config, owner=owner, outputs=outputs)
    try:
        try:
            result = await handler.func(envelope.payload, wf)
        except Exception as exc:
            if is_transient(exc) or isinstance(exc, Rejected):
                raise
            raise handler_failed(exc) from exc
        async with engine.connect() as conn, conn.begin():
            if not await inbox.hold_workflow(conn, handler.name, envelope.key, owner):
                raise WorkflowBusy(f"workflow {envelope.key!r} was taken over by another delivery")
            await inbox.complete_keys(conn, [(handler.name, envelope.key, result)])
    except BaseException:
        with contextlib.suppress(Exception):
            async with engine.connect() as conn, conn.begin():
                await inbox.release_workflow(conn, handler.name, envelope.key, owner)
        raise
    return Outcome.PROCESSED
