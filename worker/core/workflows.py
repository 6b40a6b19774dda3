"""Multi-step workflows: ordered steps, each in its own transaction, resumable after a crash.

A workflow handler calls ``await wf.step(name, fn, *args)`` for each step. A step runs ``fn(ctx,
*args)`` in a transaction of its own that also stores the step's output, makes it the inbox row's
recovery point, appends the step's events to the outbox and renews the owner's lease; its
external calls happen before that commit and carry ``ctx.step_key`` (``<key>:<step>``), the same
on every re-run. A redelivery runs the handler again from the top, and every step that committed
returns its stored output instead of running: a committed step never runs twice.

Between steps the key is ``in_progress``, owned by one delivery (``owner``) until
``lease_until``. Another delivery takes it over only by compare-and-set when the lease expired,
was released (its owner failed) or its owner is dead (its process's owner lock is gone:
``worker.core.ownership``); a live owner keeps it, and while a step's
transaction runs, its row lock keeps even an expired lease from being taken (``SKIP LOCKED``). A
delivery that finds the workflow owned raises ``WorkflowBusy``, a transient error: it is retried
later, never run beside the owner.

A workflow waits (``wf.wait_for`` a signal, with a timeout; ``wf.sleep``) holding nothing: in one
transaction it registers the wait (``workflow_waits``) and its timer (its resume message,
scheduled for the wait's deadline by the database's clock), releases its lease and commits; the
delivery is then acked (``Outcome.WAITING``). Its signal (``worker.core.signals``) or its timer
publishes the resume message, a copy of the starting message under the same key: the workflow
runs again from the top, replays its committed steps, and the wait returns what resolved it.
Exactly one of the signal and the deadline resolves a wait (``worker.sql.waits``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import uuid
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from worker.core.claims import claim, duplicate
from worker.core.codec import JSON_CONTENT_TYPE, to_jsonable
from worker.core.config import UnitOfWorkConfig
from worker.core.connection import HandlerConnection
from worker.core.context import Context
from worker.core.envelope import Envelope
from worker.core.events import Event, due
from worker.core.outcomes import Outcome
from worker.core.ownership import ownership
from worker.core.signals import RESUME_HEADER, correlation_text
from worker.errors import Rejected, Retryable, WorkerError, handler_failed, is_transient
from worker.faults import WORKFLOW_TIMEOUT_BEFORE_COMMIT, WORKFLOW_WAIT_REGISTERED, crash_point
from worker.sql import inbox, outbox, owners, waits
from worker.sql.driver import in_transaction
from worker.sql.rows import OutboxMessage

log = logging.getLogger(__name__)

AFTER_STEP = "workflow.after_step:"
"""Crash point prefix: ``workflow.after_step:<step>`` is reached just after the step committed."""

BEFORE_COMMIT = "workflow.before_commit:"
"""Crash point prefix: ``workflow.before_commit:<step>`` is reached after the step's work (its
external call included), before its transaction commits."""


TIMER_HEADER = waits.TIMER_HEADER
"""On a wait's timer (its scheduled resume message): the name of the wait it times out."""


class WorkflowBusy(Retryable):
    """Another delivery owns this workflow and its lease is live; try again later."""


class WaitTimedOut(WorkerError):
    """``wf.wait_for``'s timeout passed before its signal came; ``name`` is the wait's name."""

    def __init__(self, name: str) -> None:
        super().__init__(f"wait {name!r} timed out before its signal came")
        self.name = name


class Suspended(BaseException):
    """The workflow registered a wait and released itself: ``run`` ends with ``WAITING``.

    A ``BaseException``, so that a workflow's ``except Exception`` cannot swallow it."""


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
        self._running: str | None = None  # the step whose function runs now

    @property
    def key(self) -> str:
        """The idempotency key of the message that started the workflow."""
        return self.envelope.key

    @property
    def attempt(self) -> int:
        """1 on the message's first delivery, n + 1 after n delayed retries."""
        return self.envelope.delivery.attempt

    def _call(self, name: str) -> None:
        """Take ``name`` in the run's one namespace of steps and waits; a name used twice is an
        error (it would replay the other's output), and so is a step or wait called while a step
        runs (from its function: its transaction would wait forever on the workflow's row, which
        the running step's transaction holds)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a workflow step or wait needs a non-empty name, not {name!r}")
        if self._running is not None:
            # its transaction would wait on the row the running step's transaction holds
            raise ValueError(
                f"workflow step or wait {name!r} called while step {self._running!r} runs: "
                "call steps and waits one after another from the workflow, not from a step"
            )
        if name in self._called:
            raise ValueError(f"workflow step {name!r} is called twice")
        self._called.append(name)

    async def step(self, name: str, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Run ``fn(ctx, *args)`` as step ``name`` in its own transaction and return its output
        as stored (JSON); if the step committed in an earlier run, return that output unrun."""
        self._call(name)
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
            self._running = name
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
                self._running = None
                await ctx.close()
            crash_point(BEFORE_COMMIT + name)
        crash_point(AFTER_STEP + name)
        self.outputs[name] = output
        if ctx.outbox:
            self.config.committed_events()
        return output

    async def wait_for(
        self,
        name: str,
        routing_key: str,
        *,
        correlation: str | int,
        timeout: timedelta,  # noqa: ASYNC109 (a deadline by the database's clock)
    ) -> Any:
        """Wait, holding nothing, for the signal ``routing_key`` (one a ``router.signal``
        declared) whose correlation is ``correlation``, at most ``timeout`` by the database's
        clock; return the decoded JSON body of the signal that resumed the workflow, or raise
        ``WaitTimedOut``. A signal that came before the wait was registered resumes it too.

        The first run registers the wait and suspends the workflow (the delivery is acked);
        the run its signal or its timer starts replays to here and gets the outcome. Exactly one
        of them resolves the wait, whatever the order they arrive in.
        """
        self._call(name)
        declared = self.envelope.handler.declares_signal
        if declared is not None and not declared(routing_key):
            raise ValueError(
                f"wait {name!r}: no router.signal declares routing key {routing_key!r}"
            )
        state = await self._wait(name, routing_key, correlation_text(correlation), timeout)
        if state.outcome == waits.EVENT:
            return state.event["body"]
        raise WaitTimedOut(name)

    async def sleep(self, name: str, duration: timedelta) -> None:
        """Suspend the workflow, holding nothing, until ``duration`` has passed by the
        database's clock (from the first run that reached this sleep); then return None."""
        self._call(name)
        await self._wait(name, None, None, duration)

    async def _wait(
        self, name: str, routing_key: str | None, correlation: str | None, duration: timedelta
    ) -> waits.WaitState:
        """The resolved state of wait ``name``: registered (and the workflow suspended) on the
        first run, resolved as timed out once its deadline has passed, replayed after."""
        seconds, _ = due(duration, None)
        assert seconds is not None
        handler = self.envelope.handler.name
        registered = suspend = False
        async with self.engine.connect() as conn, conn.begin():
            if not await inbox.hold_workflow(conn, handler, self.key, self.owner):
                raise WorkflowBusy(f"workflow {self.key!r} was taken over by another delivery")
            if routing_key is not None and correlation is not None:
                await waits.lock_correlation(conn, routing_key, correlation)
            state = await waits.find_wait(conn, handler, self.key, name)
            if state is None:
                event = None
                if routing_key is not None and correlation is not None:
                    event = await waits.take_buffered_signal(
                        conn, routing_key, correlation, handler=handler, key=self.key
                    )
                resume = self._resume_message()
                await waits.register_wait(
                    conn,
                    waits.NewWait(
                        handler, self.key, name, routing_key, correlation, seconds, resume, event
                    ),
                )
                if event is not None:
                    state = waits.WaitState(waits.EVENT, event, False)
                else:
                    timer = dataclasses.replace(
                        resume, headers={**resume.headers, TIMER_HEADER: name}, due_in=seconds
                    )
                    await outbox.append_outbox(conn, [timer], notify=self.config.notify)
                    await inbox.release_workflow(conn, handler, self.key, self.owner)
                    registered = suspend = True
            elif state.outcome is None and state.due:
                await waits.resolve_wait(conn, handler, self.key, name, outcome=waits.TIMEOUT)
                state = waits.WaitState(waits.TIMEOUT, None, True)
                crash_point(WORKFLOW_TIMEOUT_BEFORE_COMMIT)
            elif state.outcome is None:
                # resumed before its time (a redelivery of the starting message): wait on
                await inbox.release_workflow(conn, handler, self.key, self.owner)
                suspend = True
        if registered:
            crash_point(WORKFLOW_WAIT_REGISTERED)
            self.config.committed_events()
        if suspend:
            log.info("workflow %s of %s waits (%s)", self.key, handler, name)
            raise Suspended(name)
        assert state is not None  # (only a wait that suspends has none)
        self._note_late_timer(name, state)
        return state

    def _resume_message(self) -> OutboxMessage:
        """The message that resumes this workflow: its starting message's body under its key,
        to its handler's routing key (the inbox sees the same fingerprint)."""
        delivery = self.envelope.delivery
        return Event(
            self.envelope.handler.routing_key,
            delivery.body,
            key=self.key,
            content_type=delivery.content_type or JSON_CONTENT_TYPE,
        ).to_outbox(
            self.config.exchange,
            causation_id=self.key,
            correlation_id=self.envelope.correlation_id,
        )

    def _note_late_timer(self, name: str, state: waits.WaitState) -> None:
        """Log a timer that came after its wait's signal won: it resolves nothing."""
        if self.envelope.delivery.headers.get(TIMER_HEADER) == name and (
            state.outcome == waits.EVENT
        ):
            log.info(
                "timer of wait %s of workflow %s came after its signal: dropped", name, self.key
            )


def _resumed_wait(envelope: Envelope) -> str | None:
    """The name of the wait this delivery resumes (it is a wait's timer, or the message its
    signal published), or None for any other delivery."""
    headers = envelope.delivery.headers
    name = headers.get(TIMER_HEADER, headers.get(RESUME_HEADER))
    return name if isinstance(name, str) else None


def _forgotten(envelope: Envelope) -> bool:
    """Whether this delivery, which just claimed its key anew, resumes a wait: then its
    workflow's key is gone (a resume is published only once its workflow's key and wait are
    committed, and such a key is deleted only by the janitor, completed or failed longer ago than
    the retention). It is a late timer (a parked outbox row retried later) and is dropped with
    its claim rolled back; running it would start the finished workflow over from its first
    step."""
    name = _resumed_wait(envelope)
    if name is None:
        return False
    log.warning(
        "resume of wait %s of workflow %s of %s came after the workflow's key expired: dropped",
        name,
        envelope.key,
        envelope.handler.name,
    )
    return True


async def _obsolete_resume(conn: AsyncConnection, envelope: Envelope) -> bool:
    """Whether this delivery resumes a wait that is resolved already (a wait's timer, or the
    message its signal published) while a live run of another message owns the workflow: that
    run replays past the wait and carries it on, and its own delivery stays unacked until it
    ends (if it dies, its redelivery finds it dead and takes over), so this one is dropped (acked
    as a duplicate) instead of retried until a long run outlasts the retry chain and it is
    parked, marking the running workflow's key failed. This is the timer that came after its
    signal won, or a second copy of a resume (a publish repeated, or the signal's resume after
    the timer, published before the signal cancelled it, took the workflow over).

    Every other delivery that finds the workflow owned is retried: a resume of a wait still
    open, any delivery while the owner is dead but its row still locked (its session ending),
    and a redelivery that may be the owner's own message (its channel closed under a live run:
    redelivered, with the owner's message id), the one message that can carry the workflow on
    if that run dies too. A copy published again (a relay's repeated publish) has the message
    id of the one that runs, but is not redelivered: it is dropped."""
    name = _resumed_wait(envelope)
    if name is None:
        return False
    handler, key = envelope.handler.name, envelope.key
    state = await waits.find_wait(conn, handler, key, name)
    if state is None or state.outcome is None:
        return False
    delivery = envelope.delivery
    if not await owners.carried_by_another(
        conn, handler, key, redelivered=delivery.redelivered, message_id=delivery.message_id
    ):
        return False
    log.info(
        "resume of wait %s of workflow %s (resolved: %s) came while another delivery runs "
        "the workflow: dropped",
        name,
        key,
        state.outcome,
    )
    return True


async def run(engine: AsyncEngine, envelope: Envelope, config: UnitOfWorkConfig) -> Outcome:
    """Run (or resume) the envelope's workflow to its end and mark its key completed.

    Returns ``WAITING`` when the workflow suspended itself on a wait (released, nothing held).
    Raises like ``unit_of_work.process``, plus ``WorkflowBusy`` when a live owner holds the
    workflow. After a failed try the workflow is released at once, so that the retry need not
    wait for the lease; its committed steps stay committed.
    """
    async with ownership(engine).held() as token:
        owner = owners.owner_of(token, envelope.delivery.message_id, uuid.uuid4().hex)
        return await _run(engine, envelope, config, owner)


async def _run(
    engine: AsyncEngine, envelope: Envelope, config: UnitOfWorkConfig, owner: str
) -> Outcome:
    """``run`` under ``owner``, whose process's owner lock is held."""
    handler = envelope.handler
    lease = config.workflow_lease
    async with engine.connect() as conn, conn.begin() as transaction:
        existing = await claim(conn, envelope, owner=owner, lease=lease)
        if existing is None and _forgotten(envelope):
            await transaction.rollback()
            return Outcome.DUPLICATE
        if existing is not None:
            if existing.status != "in_progress":
                return duplicate(existing)
            taken = await inbox.take_over_workflow(
                conn, handler.name, envelope.key, owner=owner, lease=lease
            )
            if not taken:
                if await _obsolete_resume(conn, envelope):
                    return Outcome.DUPLICATE
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
    except Suspended:
        return Outcome.WAITING  # released in the wait's own transaction
    except BaseException:
        with contextlib.suppress(Exception):
            async with engine.connect() as conn, conn.begin():
                await inbox.release_workflow(conn, handler.name, envelope.key, owner)
        raise
    return Outcome.PROCESSED
