"""Workflows that wait, against the real PostgreSQL and RabbitMQ: resumed by their signal or by
their timeout, exactly one of the two however they race, holding no delivery, lease or
transaction while they wait; a signal that comes first is kept for the wait; a sleep; and a
worker killed at each crash point of a wait resumes the workflow once."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path
from typing import Any

import pytest
from aio_pika.abc import AbstractRobustConnection
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.helpers import WORKER_SCRIPT, rows, run, scalar, wait_until
from tests.integration.support import (
    dead_letters,
    publish,
    queue_empty,
    running_relay,
    running_worker,
    settled,
    wait_for_consumer,
    worker_process,
)
from tests.integration.waiting_handlers import (
    CONFIRM_TIMEOUT,
    CONFIRMED,
    ORDER,
    REMINDER,
    router,
)
from worker import Router, Workflow
from worker.core.envelope import IDEMPOTENCY_KEY_HEADER, Delivery
from worker.core.ownership import Ownership
from worker.core.signals import RESUME_HEADER as RESUME
from worker.core.workflows import TIMER_HEADER, WorkflowBusy
from worker.faults import (
    WORKFLOW_RESUMED_BEFORE_COMMIT,
    WORKFLOW_TIMEOUT_BEFORE_COMMIT,
    WORKFLOW_WAIT_REGISTERED,
)
from worker.ops.janitor import sweep
from worker.settings import Settings
from worker.sql import inspection, outbox, owners, waits
from worker.testing import Harness

HANDLERS = {"WORKER_HANDLERS": "tests.integration.waiting_handlers"}


@pytest.fixture(autouse=True)
async def wait_effects(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "CREATE TABLE IF NOT EXISTS wait_effects "
                "(id bigserial PRIMARY KEY, key text NOT NULL, step text NOT NULL)"
            )
        )
        await conn.execute(text("TRUNCATE wait_effects"))


async def place(amqp: AbstractRobustConnection, settings: Settings, order_id: str) -> None:
    channel = await amqp.channel(publisher_confirms=True)
    await publish(
        channel, settings, {"order_id": order_id}, key=f"order-{order_id}", routing_key=ORDER
    )
    await channel.close()


async def confirm(amqp: AbstractRobustConnection, settings: Settings, body: Any) -> None:
    channel = await amqp.channel(publisher_confirms=True)
    await publish(
        channel, settings, body, key=f"confirmed-{json.dumps(body)}", routing_key=CONFIRMED
    )
    await channel.close()


async def open_waits(engine: AsyncEngine) -> int:
    return int(await scalar(engine, "SELECT count(*) FROM workflow_waits WHERE outcome IS NULL"))


async def until_waiting(engine: AsyncEngine, count: int) -> None:
    """Until ``count`` waits are open and their workflows released."""

    async def waiting() -> bool:
        released = await scalar(
            engine,
            "SELECT count(*) FROM inbox i JOIN workflow_waits w USING (handler, key)"
            " WHERE w.outcome IS NULL AND i.owner IS NULL AND i.status = 'in_progress'",
        )
        return bool(released == count)

    await wait_until(waiting)


async def until_completed(engine: AsyncEngine, count: int) -> None:
    async def completed() -> bool:
        done = await scalar(engine, "SELECT count(*) FROM inbox WHERE status = 'completed'")
        return bool(done == count)

    await wait_until(completed, timeout=40)


async def make_due(engine: AsyncEngine) -> None:
    """Move the open waits' deadlines and their timers to now (instead of sleeping), and tell
    the relay, which moves due timers into the outbox and publishes them."""
    async with engine.begin() as conn:
        await conn.execute(text("UPDATE workflow_waits SET due_at = now() WHERE outcome IS NULL"))
        await conn.execute(
            text(
                "UPDATE outbox_scheduled SET due_at = now() WHERE message_id IN"
                " (SELECT timer_id FROM workflow_waits WHERE outcome IS NULL)"
            )
        )
        notice = f"SELECT pg_notify('{outbox.OUTBOX_CHANNEL}', '{outbox.SCHEDULED_NOTICE}')"
        await conn.execute(text(notice))


async def effects(engine: AsyncEngine, key: str) -> list[str]:
    found = await rows(engine, "SELECT step FROM wait_effects WHERE key = :k ORDER BY id", k=key)
    return [step for (step,) in found]


async def result_of(engine: AsyncEngine, key: str) -> Any:
    return await scalar(engine, "SELECT result FROM inbox WHERE key = :k", k=key)


async def test_a_signal_resumes_the_waiting_workflow_which_held_nothing_meanwhile(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    async with running_worker(settings, router) as worker:
        # Given an order whose workflow reached its wait for the shipment's confirmation
        await place(amqp, settings, "o-1")
        await until_waiting(engine, 1)
        await settled(worker, waiting=1)

        # Then it holds nothing: its delivery is acked, its key has no owner and no live lease,
        # and its timer is scheduled for the wait's deadline, not before
        channel = await amqp.channel()
        assert await queue_empty(channel, settings.queue)
        owner, lease_expired = (
            await rows(
                engine, "SELECT owner, lease_until <= now() FROM inbox WHERE key = 'order-o-1'"
            )
        )[0]
        assert (owner, lease_expired) == (None, True)
        async with engine.connect() as conn, conn.begin():  # (raises if a transaction held it)
            locked = "SELECT key FROM inbox WHERE key = 'order-o-1' FOR UPDATE NOWAIT"
            assert (await conn.execute(text(locked))).scalar() == "order-o-1"
            await conn.rollback()
        timer_due, wait_due = (
            await rows(
                engine,
                "SELECT s.due_at, w.due_at FROM workflow_waits w"
                " JOIN outbox_scheduled s ON s.message_id = w.timer_id",
            )
        )[0]
        assert timer_due == wait_due

        # When its confirmation comes
        await confirm(amqp, settings, {"order_id": "o-1", "carrier": "dhl"})
        await until_completed(engine, 2)

        # Then the workflow resumed with the signal's body, its timer was cancelled, and each
        # step ran once
        assert await result_of(engine, "order-o-1") == {
            "outcome": "event",
            "confirmation": {"order_id": "o-1", "carrier": "dhl"},
        }
        assert await effects(engine, "order-o-1") == ["reserve", "complete"]
        assert await scalar(engine, "SELECT outcome FROM workflow_waits") == "event"
        assert await scalar(engine, "SELECT count(*) FROM outbox_scheduled") == 0
        resumed = await result_of(engine, 'confirmed-{"order_id": "o-1", "carrier": "dhl"}')
        assert resumed == {"resumed": [["order.placed", "order-o-1", "shipped"]]}
        await channel.close()


async def test_the_timeout_resumes_the_workflow_and_a_later_signal_is_only_recorded(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    async with running_worker(settings, router):
        # Given an order waiting for its confirmation
        await place(amqp, settings, "o-2")
        await until_waiting(engine, 1)

        # When its deadline passes (moved in SQL) and its timer is published
        await make_due(engine)
        await until_completed(engine, 1)

        # Then the workflow timed out and compensated, once
        assert await result_of(engine, "order-o-2") == {"outcome": "timeout"}
        assert await effects(engine, "order-o-2") == ["reserve", "compensate"]
        assert await scalar(engine, "SELECT outcome FROM workflow_waits") == "timeout"

        # When the confirmation comes after all
        await confirm(amqp, settings, {"order_id": "o-2"})
        await until_completed(engine, 2)

        # Then it is recorded, never applied to the wait that timed out
        assert await result_of(engine, 'confirmed-{"order_id": "o-2"}') == {"buffered": True}
        assert await scalar(engine, "SELECT outcome FROM workflow_waits") == "timeout"
        assert await effects(engine, "order-o-2") == ["reserve", "compensate"]


async def test_a_signal_and_a_timeout_that_race_resume_each_workflow_exactly_once(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    orders = [f"r-{n}" for n in range(16)]
    async with running_worker(settings, router):
        # Given orders waiting for their confirmations
        for order_id in orders:
            await place(amqp, settings, order_id)
        await until_waiting(engine, len(orders))

    # And, while no worker consumes, each one's confirmation and its timer in the queue: half
    # of the confirmations before the timers, half after (a relay alone publishes the timers)
    for order_id in orders[::2]:
        await confirm(amqp, settings, {"order_id": order_id})
    await make_due(engine)
    async with running_relay(settings):
        await wait_until(lambda: nothing_to_publish(engine))
    for order_id in orders[1::2]:
        await confirm(amqp, settings, {"order_id": order_id})

    # When a worker consumes them all at once (signals in batches beside the workflows' runs)
    async with running_worker(settings, router):
        await until_completed(engine, 2 * len(orders))
        await wait_until(lambda: nothing_to_publish(engine))

    # Then each wait was resolved by exactly one of them, and the workflow went on once, by it
    outcomes = dict(await rows(engine, "SELECT key, outcome FROM workflow_waits"))
    assert set(outcomes) == {f"order-{order_id}" for order_id in orders}
    for order_id in orders:
        key = f"order-{order_id}"
        finish = "complete" if outcomes[key] == "event" else "compensate"
        assert await effects(engine, key) == ["reserve", finish], outcomes[key]
        assert (await result_of(engine, key))["outcome"] == outcomes[key]
    # And each losing signal was recorded, not applied; each winning one resumed its wait
    signals = await rows(engine, "SELECT key, result FROM inbox WHERE handler = :h", h=CONFIRMED)
    assert len(signals) == len(orders)
    for _, result in signals:
        (resumed,) = result.get("resumed", [[None, None, None]])
        if resumed[1] is not None:
            assert outcomes[resumed[1]] == "event"
    buffered = await scalar(engine, "SELECT count(*) FROM workflow_signals")
    assert buffered == sum(1 for outcome in outcomes.values() if outcome == "timeout")


async def nothing_to_publish(engine: AsyncEngine) -> bool:
    waiting = await scalar(
        engine, "SELECT (SELECT count(*) FROM outbox) + (SELECT count(*) FROM outbox_scheduled)"
    )
    return bool(waiting == 0)


async def test_a_signal_that_comes_before_the_wait_is_kept_for_it(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    async with running_worker(settings, router) as worker:
        # Given a confirmation (its correlation an integer) that came before its order
        await confirm(amqp, settings, {"order_id": 7})
        await settled(worker, processed=1)
        assert await scalar(engine, "SELECT correlation FROM workflow_signals") == "7"

        # When the order's workflow reaches its wait
        await place(amqp, settings, "7")
        await until_completed(engine, 2)

        # Then the wait took the kept signal at once: no timer, no suspension
        assert await result_of(engine, "order-7") == {
            "outcome": "event",
            "confirmation": {"order_id": 7},
        }
        consumed = await rows(
            engine, "SELECT consumed_by_handler, consumed_by_key FROM workflow_signals"
        )
        assert consumed == [("order.placed", "order-7")]
        assert await scalar(engine, "SELECT count(*) FROM outbox_scheduled") == 0
        assert worker.stats["waiting"] == 0


async def test_a_signal_and_the_registration_of_its_wait_at_once_never_miss_each_other(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    async with running_worker(settings, router), engine.connect() as held:
        # Given the lock of the order's correlation, held by the test
        await held.begin()
        await held.execute(
            text("SELECT pg_advisory_xact_lock(:c, hashtext(:k))"),
            {"c": waits.CORRELATION_LOCK_CLASS, "k": f"{CONFIRMED}\no-5"},
        )

        # When the order's workflow registers its wait and its confirmation comes, both at once
        # (each blocked on the lock, its own transaction open, until the test lets them go)
        await place(amqp, settings, "o-5")
        await confirm(amqp, settings, {"order_id": "o-5"})

        async def both_blocked() -> bool:
            waiting = await scalar(
                engine,
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                " AND classid = :c AND database ="
                " (SELECT oid FROM pg_database WHERE datname = current_database())",
                c=waits.CORRELATION_LOCK_CLASS,
            )
            return bool(waiting == 2)

        await wait_until(both_blocked)
        await held.rollback()

        # Then whichever went first, the workflow was resumed by the signal
        await until_completed(engine, 2)
    assert (await result_of(engine, "order-o-5"))["outcome"] == "event"
    assert await effects(engine, "order-o-5") == ["reserve", "complete"]


@pytest.mark.parametrize(
    "body", [{"carrier": "dhl"}, {"order_id": None}, {"order_id": ["o-1"]}, ["o-1"]]
)
async def test_a_signal_without_a_usable_correlation_is_parked_once(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection, body: Any
) -> None:
    async with running_worker(settings, router) as worker:
        # When a confirmation without a usable order_id comes
        await confirm(amqp, settings, body)
        await settled(worker, dead_lettered=1)

    # Then it is parked once, with its reason, and nothing is recorded for a wait
    channel = await amqp.channel()
    parked = await dead_letters(channel, settings)
    assert [m.headers["x-worker-reason"] for m in parked] == ["handler-error"]
    assert "InvalidSignal" in str(parked[0].headers["x-worker-error"])
    assert await scalar(engine, "SELECT count(*) FROM workflow_signals") == 0
    await channel.close()


async def test_a_sleep_resumes_the_workflow_when_its_time_has_passed(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    async with running_worker(settings, router):
        # Given a workflow asleep
        channel = await amqp.channel(publisher_confirms=True)
        await publish(channel, settings, {"who": "ann"}, key="nap-1", routing_key=REMINDER)
        await until_waiting(engine, 1)
        assert await effects(engine, "nap-1") == []

        # When its time has passed (moved in SQL)
        await make_due(engine)
        await until_completed(engine, 1)

        # Then it went on, once
        assert await result_of(engine, "nap-1") == {"reminded": "ann"}
        assert await effects(engine, "nap-1") == ["remind"]
        waits = await rows(engine, "SELECT routing_key, correlation, outcome FROM workflow_waits")
        assert waits == [(None, None, "timeout")]
        await channel.close()


@pytest.mark.parametrize(
    ("crash_at", "outcome"),
    [
        (WORKFLOW_WAIT_REGISTERED, "event"),
        (WORKFLOW_RESUMED_BEFORE_COMMIT, "event"),
        (WORKFLOW_TIMEOUT_BEFORE_COMMIT, "timeout"),
    ],
)
async def test_a_worker_killed_at_a_crash_point_of_a_wait_resumes_the_workflow_once(
    settings: Settings,
    engine: AsyncEngine,
    amqp: AbstractRobustConnection,
    tmp_path: Path,
    crash_at: str,
    outcome: str,
) -> None:
    log = tmp_path / "worker.log"

    async def resolve() -> None:
        if outcome == "event":
            await confirm(amqp, settings, {"order_id": "k-1"})
        else:
            await make_due(engine)

    # Given a worker that kills itself at the crash point
    with worker_process(settings, log, WORKER_CRASH_AT=crash_at, **HANDLERS) as worker:
        await wait_for_consumer(amqp, settings.queue)
        await place(amqp, settings, "k-1")
        if crash_at != WORKFLOW_WAIT_REGISTERED:
            await until_waiting(engine, 1)
            await resolve()
        await asyncio.to_thread(worker.wait, 60)
        assert worker.returncode == -signal.SIGKILL, log.read_text(errors="replace")

    # When the dead owner's lease (if it held one) has run out, moved back in SQL, and a worker
    # starts again (and, if the crash came first, the wait is resolved)
    async with engine.begin() as conn:
        await conn.execute(text("UPDATE inbox SET lease_until = now() - interval '1 second'"))
    with worker_process(settings, log, **HANDLERS) as worker:
        if crash_at == WORKFLOW_WAIT_REGISTERED:
            await until_waiting(engine, 1)
            await resolve()
        await until_completed(engine, 2 if outcome == "event" else 1)
        worker.send_signal(signal.SIGTERM)
        await asyncio.to_thread(worker.wait, 30)

    # Then the workflow resumed once, by the one outcome, and registered its wait once
    finish = "complete" if outcome == "event" else "compensate"
    assert await effects(engine, "order-k-1") == ["reserve", finish]
    assert await rows(engine, "SELECT outcome FROM workflow_waits") == [(outcome,)]


async def test_worker_workflows_shows_what_each_waiting_workflow_waits_for_and_until_when(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    async with running_worker(settings, router):
        # Given a workflow waiting for a signal and one asleep
        await place(amqp, settings, "o-9")
        channel = await amqp.channel(publisher_confirms=True)
        await publish(channel, settings, {"who": "bo"}, key="nap-9", routing_key=REMINDER)
        await channel.close()
        await until_waiting(engine, 2)

    # When an operator lists the workflows
    listed = await asyncio.to_thread(
        run, WORKER_SCRIPT, "workflows", WORKER_DATABASE_URL=settings.database_url
    )
    as_json = await asyncio.to_thread(
        run, WORKER_SCRIPT, "workflows", "--json", WORKER_DATABASE_URL=settings.database_url
    )

    # Then each shows its wait and its deadline by the database's clock, and no owner
    due = dict(await rows(engine, "SELECT key, due_at FROM workflow_waits"))
    out = listed.stdout + listed.stderr
    assert "key=order-o-9 recovery_point=reserve owner=- " in listed.stdout, out
    until = due["order-o-9"].isoformat()
    assert f"waiting=shipped signal={CONFIRMED} correlation=o-9 until={until}" in out
    assert f"waiting=nap sleep until={due['nap-9'].isoformat()}" in listed.stdout
    assert "2 workflow(s) in progress, 2 of them waiting" in listed.stdout
    shown = {state["key"]: state for state in map(json.loads, as_json.stdout.splitlines())}
    assert shown["order-o-9"]["wait_correlation"] == "o-9"
    assert shown["nap-9"]["wait"] == "nap"
    assert shown["nap-9"]["wait_routing_key"] is None


async def test_a_waiting_workflow_is_stuck_only_once_its_deadline_is_long_past(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    async with running_worker(settings, router):
        # Given a waiting workflow, whose lease it released long ago (moved in SQL)
        await place(amqp, settings, "o-10")
        await until_waiting(engine, 1)
    async with engine.begin() as conn:
        await conn.execute(text("UPDATE inbox SET lease_until = now() - interval '1 day'"))

    async def stuck() -> int:
        async with engine.connect() as conn:
            total, _ = await inspection.expired_workflows(conn, [], expired_for=60, limit=10)
        return total

    # Then it is not stuck while its deadline is ahead, nor is it the oldest running one
    assert await stuck() == 0
    async with engine.connect() as conn:
        assert await inspection.in_progress_workflows(conn, 1, waiting=False) == []

    # When its deadline passed long ago and nothing resumed it (its timer lost, moved in SQL)
    async with engine.begin() as conn:
        await conn.execute(text("UPDATE workflow_waits SET due_at = now() - interval '1 hour'"))

    # Then it is stuck
    assert await stuck() == 1


async def test_the_janitor_drops_signals_older_than_the_retention(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    async with running_worker(settings, router) as worker:
        # Given two signals nobody waited for, one received longer ago than the retention
        await confirm(amqp, settings, {"order_id": "old"})
        await confirm(amqp, settings, {"order_id": "new"})
        await settled(worker, processed=2)
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "UPDATE workflow_signals SET received_at = now() - make_interval(secs => :s)"
                " WHERE correlation = 'old'"
            ),
            {"s": settings.inbox_retention + 60},
        )

    # When the janitor sweeps
    await sweep(engine, settings)

    # Then the old one is gone and the recent one kept
    assert await rows(engine, "SELECT correlation FROM workflow_signals") == [("new",)]


async def test_the_harness_runs_a_waiting_workflow_through_its_signal_and_its_timer(
    engine: AsyncEngine,
) -> None:
    harness = Harness(router, engine)

    # Given two orders waiting for their confirmations, in the in-memory harness
    placed = [
        await harness.deliver(ORDER, {"order_id": order_id}, key=f"order-{order_id}")
        for order_id in ("h-1", "h-2")
    ]
    assert [d.outcome for d in placed] == ["waiting", "waiting"]

    # When one's confirmation comes (its delivery drains the outbox: the resume message) and
    # the other's deadline passes (the harness moves it, and drains the timer)
    signalled = await harness.deliver(CONFIRMED, {"order_id": "h-1"}, key="c-1")
    assert signalled.result == {"resumed": [[ORDER, "order-h-1", "shipped"]]}
    resumes = [*signalled.events, *await harness.advance(CONFIRM_TIMEOUT)]

    # Then each resume message runs its workflow to its end, by its one outcome
    ended = [await harness.deliver_event(event) for event in resumes]
    assert sorted((d.outcome, d.result["outcome"]) for d in ended) == [
        ("processed", "event"),
        ("processed", "timeout"),
    ]


async def test_a_wait_for_an_undeclared_signal_fails_the_workflow(engine: AsyncEngine) -> None:
    # Given a workflow that waits for a routing key no router.signal declared
    lonely = Router()

    @lonely.workflow("lonely.started")
    async def wait_alone(body: Any, wf: Workflow) -> None:
        await wf.wait_for("never", "nobody.sends", correlation="x", timeout=CONFIRM_TIMEOUT)

    # When it runs, it is parked, and nothing waits
    ended = await Harness(lonely, engine).deliver("lonely.started", {}, key="l-1")
    assert ended.outcome == "dead_lettered"
    assert "no router.signal declares routing key 'nobody.sends'" in str(ended.error)
    assert await scalar(engine, "SELECT count(*) FROM workflow_waits") == 0


async def test_a_timer_late_for_a_workflow_another_live_delivery_runs_is_dropped_not_retried(
    engine: AsyncEngine,
) -> None:
    harness = Harness(router, engine)
    body = {"order_id": "t-1"}

    # Given a workflow whose wait its signal resolved, now run by another message (its resume
    # message took it over) in a live process: its owner lock held, its lease running
    assert (await harness.deliver(ORDER, body, key="order-t-1")).outcome == "waiting"
    await harness.deliver(CONFIRMED, {"order_id": "t-1"}, key="c-t-1")
    live = Ownership(engine)
    async with live.held() as token:
        await own(engine, "order-t-1", owners.owner_of(token, "resume-1", "run-1"))

        # When the wait's timer comes anyway (published before the signal cancelled it)
        late = await harness.deliver(
            ORDER, body, key="order-t-1", message_id="timer-1", headers={TIMER_HEADER: "shipped"}
        )

        # Then it is acked as a duplicate: the live run carries the workflow on
        assert late.outcome == "duplicate"

        # While a redelivery of the owner's own message is retried (if the run dies, it is the
        # one message that can carry the workflow on), as is any other delivery of the running
        # workflow and a timer of a wait still open
        with pytest.raises(WorkflowBusy):
            await harness.handle(resume_of(body, "order-t-1", "resume-1", redelivered=True))
        # (a second copy of the owner's message, published again, was never handed to it)
        second = await harness.handle(resume_of(body, "order-t-1", "resume-1", redelivered=False))
        assert second.outcome == "duplicate"
        with pytest.raises(WorkflowBusy):
            await harness.deliver(ORDER, body, key="order-t-1")
        with pytest.raises(WorkflowBusy):
            await harness.deliver(ORDER, body, key="order-t-1", headers={TIMER_HEADER: "other"})


async def test_a_resume_redelivered_after_its_owner_died_takes_the_workflow_over_at_once(
    engine: AsyncEngine,
) -> None:
    harness = Harness(router, engine)
    body = {"order_id": "t-2"}

    # Given a workflow its signal's resume message took over, in a process that then died
    # (its owner lock gone with its session) with its lease still running for an hour
    assert (await harness.deliver(ORDER, body, key="order-t-2")).outcome == "waiting"
    await harness.deliver(CONFIRMED, {"order_id": "t-2"}, key="c-t-2")
    dead = Ownership(engine)
    async with dead.held() as token:
        await own(engine, "order-t-2", owners.owner_of(token, "resume-2", "run-1"))

    # When the broker redelivers that resume message, or the wait's timer comes
    again = await harness.handle(resume_of(body, "order-t-2", "resume-2", redelivered=True))

    # Then it takes the dead owner's workflow over and completes it, not dropped as a duplicate
    assert again.outcome == "processed"
    assert await scalar(engine, "SELECT status FROM inbox WHERE key = 'order-t-2'") == "completed"


def resume_of(body: Any, key: str, message_id: str, *, redelivered: bool) -> Delivery:
    """The resume message of the order's wait ``shipped``, as the broker hands it over."""
    return Delivery(
        body=json.dumps(body).encode(),
        routing_key=ORDER,
        headers={IDEMPOTENCY_KEY_HEADER: key, RESUME: "shipped"},
        message_id=message_id,
        content_type="application/json",
        redelivered=redelivered,
    )


async def own(engine: AsyncEngine, key: str, owner: str) -> None:
    """Make ``owner`` the workflow's owner, its lease running for an hour."""
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "UPDATE inbox SET owner = :owner, lease_until = now() + interval '1 hour'"
                " WHERE key = :key"
            ),
            {"owner": owner, "key": key},
        )
