"""``worker status`` and ``worker outbox list|retry``, run for real against PostgreSQL and RabbitMQ.

Rows are written with SQL; the queues exist only after the topology was declared, as a worker
would; status must report what it can read and say which service it could not.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import subprocess
from datetime import timedelta

import aio_pika
from aio_pika.abc import AbstractRobustConnection
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from examples.payments import router as payments
from tests.helpers import WORKER_SCRIPT, rows, run, scalar, wait_until, worker_environ
from tests.integration.support import (
    ROUTING_KEY,
    add_outbox_row,
    declare,
    make_overdue,
    park,
    running_relay,
    running_worker,
    schedule,
)
from worker import Router, Workflow
from worker.ops import admin
from worker.settings import Settings
from worker.testing import Harness, empty_database


async def worker(settings: Settings, *argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``worker *argv`` in a subprocess, off the event loop (the broker connection stays alive)."""
    return await asyncio.to_thread(run, WORKER_SCRIPT, *argv, **worker_environ(settings, **env))


async def add_inbox_keys(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "INSERT INTO inbox (handler, key, fingerprint, status, recovery_point, "
                "routing_key, owner, lease_until, updated_at) VALUES "
                "('h', 'done-1', '\\x00', 'completed', NULL, 'r', NULL, NULL, now()), "
                "('h', 'done-2', '\\x00', 'completed', NULL, 'r', NULL, NULL, now()), "
                "('h', 'broken', '\\x00', 'failed', NULL, 'r', NULL, NULL, now()), "
                "('order.placed', 'order-1', '\\x00', 'in_progress', 'reserve_inventory', "
                "'order.placed', 'delivery-1', now(), now() - interval '5 min')"
            )
        )


async def given_a_busy_worker(
    engine: AsyncEngine, amqp: AbstractRobustConnection, settings: Settings
) -> None:
    """The topology with one ready message; two pending outbox rows (one waiting for a retry,
    the oldest a minute old), one parked, two events scheduled (one of them due 30 seconds ago,
    not moved: no relay runs), and inbox keys of every status."""
    await declare(amqp, settings)
    async with amqp.channel() as channel:
        await channel.default_exchange.publish(
            aio_pika.Message(b"{}", message_id="m-1"), routing_key=settings.queue
        )
    await add_outbox_row(engine, settings, age=60.0)
    await add_outbox_row(engine, settings, waiting=True)
    await park(engine, settings)
    overdue, _ = await schedule(engine, settings, timedelta(hours=1), timedelta(hours=2))
    await make_overdue(engine, overdue, 30.0)
    await add_inbox_keys(engine)


def line(output: str, label: str) -> str:
    """The value printed after ``label`` on its line of ``worker status``."""
    found = re.search(rf"^{re.escape(label)}\s+(.*)$", output, re.MULTILINE)
    assert found is not None, f"no line {label!r} in:\n{output}"
    return found.group(1)


async def test_status_shows_queues_outbox_inbox_and_workflows(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    await given_a_busy_worker(engine, amqp, settings)

    result = await worker(settings, "status")

    assert result.returncode == 0, result.stderr
    out = result.stdout
    # first what a person needs first, then the detail
    headline = [text.split()[0] for text in out.split("\n\n")[0].splitlines()]
    assert headline == ["consuming", "waiting", "dead-lettered", "outbox", "outbox"]
    assert line(out, "consuming") == f"no: nobody consumes {settings.queue} (stopped, or paused)"
    assert line(out, "waiting") == f"1 message(s) ready in {settings.queue}"
    assert line(out, "dead-lettered") == f"0 in {settings.dead_letter_queue}"
    assert line(out, f"queue {settings.queue}") == "messages=1 consumers=0"
    assert line(out, f"queue {settings.dead_letter_queue}") == "messages=0 consumers=0"
    for delay in settings.retry_delays:
        assert line(out, f"queue {settings.retry_queue(delay)}") == "messages=0 consumers=0"
    backlog = re.fullmatch(r"2 \(oldest (\d+\.\d)s\)", line(out, "outbox backlog"))
    assert backlog is not None
    assert 60 <= float(backlog.group(1)) < 120
    assert line(out, "outbox waiting for a retry") == "1"
    assert line(out, "outbox parked") == "1"
    scheduled = re.fullmatch(r"2 \(earliest overdue by (\d+\.\d)s\)", line(out, "outbox scheduled"))
    assert scheduled is not None
    assert 30 <= float(scheduled.group(1)) < 90
    assert line(out, "inbox completed") == "2"
    assert line(out, "inbox failed") == "1"
    assert line(out, "inbox in_progress") == "1"
    workflows = line(out, "workflows in progress")
    assert workflows.startswith("1 (oldest: handler=order.placed key=order-1 ")
    assert "recovery_point=reserve_inventory" in workflows


async def test_status_says_first_that_a_worker_consumes(settings: Settings) -> None:
    async with running_worker(settings, payments):
        result = await worker(settings, "status")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("consuming ")
    assert line(result.stdout, "consuming") == f"yes: 1 consumer(s) on {settings.queue}"


async def test_status_json_is_one_object(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    await given_a_busy_worker(engine, amqp, settings)

    result = await worker(settings, "status", "--json")

    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    queues = {queue["name"]: queue for queue in status["queues"]}
    assert queues[settings.queue] == {
        "role": "work",
        "name": settings.queue,
        "exists": True,
        "messages": 1,
        "consumers": 0,
    }
    assert queues[settings.dead_letter_queue]["role"] == "dead letters"
    assert len(queues) == 2 + len(settings.retry_delays)
    outbox = status["database"]["outbox"]
    assert 60 <= outbox.pop("oldest_age_seconds") < 120
    assert 30 <= outbox.pop("scheduled_overdue_seconds") < 90
    assert outbox == {
        "backlog": 2,
        "waiting_for_retry": 1,
        "parked": 1,
        "scheduled": 2,
        "scheduled_estimated": False,
    }
    assert status["database"]["inbox"] == {"in_progress": 1, "completed": 2, "failed": 1}
    workflows = status["database"]["workflows"]
    assert workflows["in_progress"] == 1
    assert workflows["oldest"]["key"] == "order-1"
    assert workflows["oldest"]["recovery_point"] == "reserve_inventory"
    assert status["errors"] == {}


async def test_status_counts_the_waiting_workflows_and_shows_none_as_the_oldest(
    settings: Settings, engine: AsyncEngine
) -> None:
    # Given a workflow sleeping for an hour: in progress, on purpose
    router = Router()

    @router.workflow("nap.requested")
    async def nap(body: dict[str, str], wf: Workflow) -> None:
        await wf.sleep("nap", timedelta(hours=1))

    assert (await Harness(router, engine).deliver("nap.requested", {}, key="n1")).outcome == (
        "waiting"
    )

    # When an operator asks for the status, as text and as JSON
    result = await worker(settings, "status")
    as_json = await worker(settings, "status", "--json")

    # Then it is counted as waiting, and not shown as the likeliest to be stuck
    assert line(result.stdout, "workflows in progress") == "1, 1 of them waiting"
    workflows = json.loads(as_json.stdout)["database"]["workflows"]
    assert workflows == {"in_progress": 1, "oldest": None, "waiting": 1}


async def test_status_of_an_idle_worker_reports_missing_queues_and_empty_tables(
    settings: Settings,
) -> None:
    result = await worker(settings, "status", "--json")

    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert {queue["exists"] for queue in status["queues"]} == {False}
    assert status["database"]["outbox"] == {
        "backlog": 0,
        "oldest_age_seconds": None,
        "waiting_for_retry": 0,
        "parked": 0,
        "scheduled": 0,
        "scheduled_estimated": False,
        "scheduled_overdue_seconds": 0.0,
    }
    assert status["database"]["workflows"] == {"in_progress": 0, "oldest": None, "waiting": 0}
    text_result = await worker(settings, "status")
    assert line(text_result.stdout, f"queue {settings.queue}") == "missing"
    assert line(text_result.stdout, "consuming").startswith("no: queue ")
    assert line(text_result.stdout, "outbox backlog") == "0"
    assert line(text_result.stdout, "outbox scheduled") == "0"


async def test_status_with_an_unreachable_database_exits_3_and_still_shows_the_broker(
    settings: Settings, amqp: AbstractRobustConnection
) -> None:
    await declare(amqp, settings)

    result = await worker(
        settings, "status", WORKER_DATABASE_URL="postgresql://postgres@127.0.0.1:1/x"
    )

    assert result.returncode == 3
    assert "PostgreSQL at postgresql://postgres@127.0.0.1:1/x" in result.stderr
    assert "Traceback" not in result.stderr
    assert line(result.stdout, "database") == "unavailable"
    assert line(result.stdout, f"queue {settings.queue}") == "messages=0 consumers=0"


async def test_status_with_an_unreachable_broker_exits_3_and_still_shows_the_database(
    settings: Settings, engine: AsyncEngine
) -> None:
    await park(engine, settings)

    result = await worker(
        settings, "status", "--json", WORKER_AMQP_URL="amqp://guest:secret@127.0.0.1:1/"
    )

    assert result.returncode == 3
    assert "RabbitMQ at amqp://guest:***@127.0.0.1:1/" in result.stderr
    assert "secret" not in result.stderr + result.stdout
    status = json.loads(result.stdout)
    assert status["queues"] is None
    assert status["database"]["outbox"]["parked"] == 1
    assert set(status["errors"]) == {"broker"}


async def test_outbox_list_shows_the_parked_rows(settings: Settings, engine: AsyncEngine) -> None:
    row_id, message_id = await park(engine, settings, ordering_key="acct-1")

    result = await worker(settings, "outbox", "list")
    as_json = await worker(settings, "outbox", "list", "--json")

    assert result.returncode == 0, result.stderr
    assert f"id={row_id} message_id={message_id} exchange={settings.exchange} " in result.stdout
    assert f"routing_key={ROUTING_KEY} ordering_key=acct-1 attempts=1 " in result.stdout
    assert "last_error='unroutable: NO_ROUTE'" in result.stdout
    assert "1 parked outbox row(s) shown" in result.stdout
    assert as_json.returncode == 0, as_json.stderr
    (row,) = [json.loads(text_line) for text_line in as_json.stdout.splitlines()]
    assert row["id"] == row_id
    assert row["message_id"] == str(message_id)
    assert row["attempts"] == 1
    assert row["last_error"] == "unroutable: NO_ROUTE"
    assert row["state"] == "parked"
    assert row["available_at"] is None
    assert set(row) == {
        "state",
        "available_at",
        "due_in_seconds",
        "id",
        "message_id",
        "exchange",
        "routing_key",
        "attempts",
        "last_error",
        "created_at",
        "parked_at",
        "ordering_key",
        "timer",
    }
    assert row["timer"] is None


async def test_outbox_retry_moves_a_parked_row_back_under_its_message_id(
    settings: Settings, engine: AsyncEngine
) -> None:
    row_id, message_id = await park(engine, settings)
    other_id, _ = await park(engine, settings)

    result = await worker(settings, "outbox", "retry", "--id", str(row_id))

    assert result.returncode == 0, result.stderr
    assert "1 parked outbox row(s) moved back into the outbox" in result.stdout
    ((new_id, attempts, last_error, due),) = await rows(
        engine,
        "SELECT id, attempts, last_error, available_at <= now() FROM outbox WHERE message_id = :m",
        m=message_id,
    )
    assert new_id > other_id  # a new identity, after every earlier row
    assert f"retried id={row_id} as id={new_id} message_id={message_id}" in result.stdout
    assert (attempts, last_error, due) == (0, "unroutable: NO_ROUTE", True)
    parked = await rows(engine, "SELECT id FROM outbox_parked")
    assert parked == [(other_id,)]


async def test_outbox_retry_of_all_rows_sums_them_up_unless_verbose(
    settings: Settings, engine: AsyncEngine
) -> None:
    for _ in range(5):
        await park(engine, settings)

    result = await worker(settings, "outbox", "retry", "--all")

    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"retried by routing key: {ROUTING_KEY}: 5",
        "0 backing-off outbox row(s) made due now, 5 parked outbox row(s) moved back into the "
        "outbox",
    ]


async def test_outbox_retry_of_an_id_that_matches_nothing_is_an_error(
    settings: Settings, engine: AsyncEngine
) -> None:
    result = await worker(settings, "outbox", "retry", "--id", "424242")

    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines() == [
        "worker: error: no backing-off or parked outbox row has id 424242 "
        "(see `worker outbox list`)"
    ]
    assert "0 parked outbox row(s) moved" in result.stdout


async def test_outbox_retry_needs_ids_or_all(settings: Settings) -> None:
    neither = await worker(settings, "outbox", "retry")
    both = await worker(settings, "outbox", "retry", "--id", "1", "--all")

    assert neither.returncode == 2
    assert "one of the arguments --id --routing-key --all is required" in neither.stderr
    assert both.returncode == 2
    assert "not allowed with argument" in both.stderr


async def test_retry_all_keeps_the_relative_order_and_puts_a_key_after_its_newer_rows(
    settings: Settings, engine: AsyncEngine
) -> None:
    first_id, first = await park(engine, settings, ordering_key="acct-1")
    second_id, second = await park(engine, settings, ordering_key="acct-1")
    _, newer = await add_outbox_row(engine, settings, ordering_key="acct-1")

    retried = await admin.retry_outbox(settings)

    assert [(row.parked_id, row.message_id) for row in retried.moved] == [
        (first_id, first),
        (second_id, second),
    ]
    assert retried.unknown == []
    order = await rows(engine, "SELECT message_id FROM outbox ORDER BY id")
    assert [message_id for (message_id,) in order] == [newer, first, second]
    assert await scalar(engine, "SELECT count(*) FROM outbox_parked") == 0


async def test_a_relay_publishes_a_retried_row_under_its_message_id(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    await declare(amqp, settings)
    row_id, message_id = await park(engine, settings)
    await admin.retry_outbox(settings, [row_id])

    async with running_relay(settings):

        async def published() -> bool:
            return bool(await scalar(engine, "SELECT count(*) FROM outbox") == 0)

        await wait_until(published)

    async with amqp.channel() as channel:
        queue = await channel.declare_queue(settings.queue, passive=True)
        message = await queue.get(no_ack=True, fail=False)
    assert message is not None
    assert message.message_id == str(message_id)


async def test_status_says_the_broker_refused_the_login_not_that_it_cannot_be_reached(
    settings: Settings, engine: AsyncEngine
) -> None:
    # Given a RabbitMQ that answers, and a wrong password
    wrong = settings.amqp_url.replace("guest:guest@", "guest:not-the-password@")
    assert wrong != settings.amqp_url

    # When status reads it
    result = await worker(settings, "status", WORKER_AMQP_URL=wrong)

    # Then it says what to fix, not that the broker is down
    assert result.returncode == 3
    assert "RabbitMQ refused the login" in result.stderr
    assert "cannot reach RabbitMQ" not in result.stderr
    assert "not-the-password" not in result.stderr + result.stdout


async def test_status_of_a_database_without_the_worker_tables_says_run_migrate(
    settings: Settings, amqp: AbstractRobustConnection
) -> None:
    # Given a PostgreSQL that answers, in a database the migrations never ran in
    await declare(amqp, settings)
    empty = contextlib.ExitStack()  # (empty_database runs its own event loop: in a thread)
    scratch = await asyncio.to_thread(empty.enter_context, empty_database(settings))
    try:
        # When status reads it
        result = await worker(settings, "status", WORKER_DATABASE_URL=scratch.database_url)
    finally:
        await asyncio.to_thread(empty.close)

    # Then it names the fix
    assert result.returncode == 3
    assert "run `worker migrate` first" in result.stderr
    assert "cannot reach PostgreSQL" not in result.stderr
