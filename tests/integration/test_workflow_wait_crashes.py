"""The orders workflow's wait and compensation in real ``worker run`` and ``worker relay``
processes, one of them killed with SIGKILL at a crash point: between the wait's registration and
its ack, between the timer firing and the resume's commit, between the confirmation's resolve and
its commit, in and after each compensation step, and in the relay after the timer was published.
After a restart, the dead owner's lease still running, the redelivered message (the timer, for a
crash in the timeout's path) takes the workflow over and every effect happened once: the stock
moved back once, the charge was refunded once (a re-run refund call carries the same step key),
each event went out once."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from aio_pika.abc import AbstractRobustConnection
from sqlalchemy.ext.asyncio import AsyncEngine

from examples.orders import add_stock
from tests.helpers import rows, scalar, wait_until
from tests.integration.orders_flow import (
    cancelled_once,
    completed,
    confirm_shipping,
    drain,
    effects,
    events_queue,
    expire_wait,
    place_order,
    relayed,
    shipped_once,
    waiting,
)
from tests.integration.support import declare, wait_for_consumer, worker_process
from worker import faults
from worker.core.workflows import AFTER_STEP, BEFORE_COMMIT, TIMER_HEADER
from worker.settings import Settings

HANDLERS = {"WORKER_HANDLERS": "examples.orders"}
CONFIRM, EXPIRE = "confirm", "expire"


@dataclass(frozen=True)
class Crash:
    """Which process dies where, and what then ends the wait."""

    point: str
    resolve: str
    process: str = "run"
    refund_calls: int = 1

    @property
    def before_wait(self) -> bool:
        """Dies before the workflow is seen waiting (while it registers its wait)."""
        return self.point == faults.WORKFLOW_WAIT_REGISTERED


CRASHES = [
    Crash(faults.WORKFLOW_WAIT_REGISTERED, EXPIRE),
    Crash(faults.WORKFLOW_WAIT_REGISTERED, CONFIRM),
    Crash(faults.WORKFLOW_TIMEOUT_BEFORE_COMMIT, EXPIRE),
    Crash(faults.WORKFLOW_RESUMED_BEFORE_COMMIT, CONFIRM),
    Crash(BEFORE_COMMIT + "release_reservation", EXPIRE),
    Crash(AFTER_STEP + "release_reservation", EXPIRE),
    # the gateway was called, the step did not commit: it runs again under the same step key
    Crash(BEFORE_COMMIT + "refund_payment", EXPIRE, refund_calls=2),
    Crash(AFTER_STEP + "refund_payment", EXPIRE),
    Crash(BEFORE_COMMIT + "cancel_order", EXPIRE),
    Crash(AFTER_STEP + "cancel_order", EXPIRE),
    # the timer's delivery (the second message the worker takes) committed the cancelled
    # result and died before its ack: the redelivered timer finds the key completed
    Crash(faults.CONSUMER_AFTER_COMMIT + "@2", EXPIRE),
    # the relay published order.shipped (1) and the timer (2), and died before deleting the timer
    Crash(faults.RELAY_AFTER_PUBLISH + "@2", EXPIRE, process="relay"),
]


@contextmanager
def processes(
    settings: Settings, log: Path, crash: Crash | None
) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """A consuming ``worker run`` (no relay of its own) and a ``worker relay``; the one named by
    ``crash`` dies at its point."""
    with ExitStack() as stack:
        started = {}
        for command in ("run", "relay"):
            env = dict(HANDLERS, WORKER_RELAY="false")
            if crash is not None and crash.process == command:
                env[faults.CRASH_ENV] = crash.point
            started[command] = stack.enter_context(worker_process(settings, log, command, **env))
        yield started


async def stop(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGTERM)
    await asyncio.to_thread(process.wait, 30)


@pytest.mark.parametrize("crash", CRASHES, ids=lambda crash: f"{crash.point}-{crash.resolve}")
async def test_a_killed_wait_resumes_once_and_compensates_once(
    settings: Settings,
    engine: AsyncEngine,
    amqp: AbstractRobustConnection,
    tmp_path: Path,
    crash: Crash,
) -> None:
    async with engine.begin() as conn:
        await add_stock(conn, "tea", 10)
    log = tmp_path / "worker.log"
    await declare(amqp, settings)
    channel = await amqp.channel(publisher_confirms=True)
    events = await events_queue(channel, settings)

    async def resolve() -> None:
        if crash.resolve == CONFIRM:
            await confirm_shipping(channel, settings, "o-1")
        else:
            await expire_wait(engine, "o-1")

    # Given a worker and a relay, one of which kills itself at the crash point
    with processes(settings, log, crash) as running:
        await wait_for_consumer(amqp, settings.queue)
        await place_order(channel, settings, "o-1")
        if not crash.before_wait:
            # When the order waits for its confirmation and its wait is then ended
            await wait_until(lambda: waiting(engine, "o-1"), timeout=40)
            await resolve()
        victim = running[crash.process]
        await asyncio.to_thread(victim.wait, 60)
        assert victim.returncode == -signal.SIGKILL, log.read_text(errors="replace")
        for process in running.values():
            if process.poll() is None:
                await stop(process)
    if crash.process == "relay":
        # (it died with the timer published and still in the outbox, to be published again)
        timers = "SELECT count(*) FROM outbox WHERE headers ? :timer"
        assert await scalar(engine, timers, timer=TIMER_HEADER) == 1

    # When both start again, the dead owner's lease still running (its redelivered message, the
    # timer among them, must see the owner dead and take the workflow over, not drop itself)
    with processes(settings, log, None) as running:
        if crash.before_wait:
            # (the replayed order found its wait registered: one wait, one timer, not two)
            await wait_until(lambda: waiting(engine, "o-1"), timeout=40)
            assert await scalar(engine, "SELECT count(*) FROM outbox_scheduled") == 1
            await resolve()
        await wait_until(lambda: completed(engine, "o-1"), timeout=40)
        await wait_until(lambda: relayed(engine))
        for process in running.values():
            await stop(process)

    # Then the order was shipped, or released, refunded and cancelled, once
    found = await effects(engine, "o-1")
    if crash.resolve == CONFIRM:
        assert shipped_once(found, "o-1"), found
        assert await scalar(engine, "SELECT available FROM stock WHERE sku = 'tea'") == 8
        expected = [("order.shipped", "o-1")]
    else:
        assert cancelled_once(found, "o-1"), found
        assert found.refund_calls == crash.refund_calls
        assert await scalar(engine, "SELECT available FROM stock WHERE sku = 'tea'") == 10
        expected = [("order.shipped", "o-1"), ("order.cancelled", "o-1")]
    assert await drain(events) == expected
    # And the wait was resolved once, its timer published or cancelled, nothing left over
    outcomes = await rows(engine, "SELECT outcome FROM workflow_waits")
    assert [outcome for (outcome,) in outcomes] == [
        "event" if crash.resolve == CONFIRM else "timeout"
    ]
    assert await scalar(engine, "SELECT count(*) FROM outbox_scheduled") == 0
    await channel.close()
