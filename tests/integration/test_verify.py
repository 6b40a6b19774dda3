"""``worker verify`` against the real PostgreSQL and RabbitMQ: a clean run of payments through a
running worker passes every invariant; each kind of damage, written with SQL or put on a queue,
fails the invariant that guards against it (and only that one), with exit 1."""

from __future__ import annotations

import asyncio
import json
import subprocess
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import aio_pika
import pytest
from aio_pika.abc import AbstractRobustConnection
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from examples.payments import invariants as payments_invariants
from examples.payments import router as payments
from tests.helpers import WORKER_SCRIPT, payment, run, scalar, wait_until, worker_environ
from tests.integration.support import EXAMPLES, running_worker
from worker import Router, Workflow
from worker.ops import verify
from worker.settings import Settings
from worker.testing import Harness
from worker.transport.topology import declare_topology

WORKER_CHECKS = {
    "no-stuck-inbox-keys",
    "no-stuck-workflows",
    "no-orphaned-workflows",
    "outbox-drained",
    "outbox-nothing-parked",
    "dead-letters",
}
PAYMENTS_CHECKS = {"balances-match-ledger", "one-notice-per-settlement"}

PAYMENTS = [
    payment("p1", "alice", 100),
    payment("p2", "alice", 250),
    payment("p3", "bob", 40),
    payment("p4", "carol", 999),
    payment("p5", "bob", 1),
]
EXPECTED = {"alice": 350, "bob": 41, "carol": 999}


def environ(settings: Settings, **extra: str) -> dict[str, str]:
    return worker_environ(settings, **{"WORKER_HANDLERS": "examples.payments", **extra})


async def worker_verify(
    settings: Settings, *argv: str | Path, **env: str
) -> subprocess.CompletedProcess[str]:
    """``worker verify *argv`` in a subprocess, off the event loop."""
    return await asyncio.to_thread(run, WORKER_SCRIPT, "verify", *argv, **environ(settings, **env))


def results(output: str) -> dict[str, tuple[bool, str]]:
    """``{name: (ok, detail)}`` from the PASS/FAIL lines of ``worker verify``."""
    found: dict[str, tuple[bool, str]] = {}
    for line in output.splitlines():
        verdict, _, rest = line.partition(" ")
        name, _, detail = rest.partition(": ")
        assert verdict in {"PASS", "FAIL"}, line
        found[name] = (verdict == "PASS", detail)
    return found


def failed(output: str) -> set[str]:
    return {name for name, (ok, _) in results(output).items() if not ok}


@pytest.fixture
async def capture_queue(settings: Settings, amqp: AbstractRobustConnection) -> AsyncIterator[str]:
    """A downstream queue bound to ``payment.settled`` on the test's exchange, deleted after."""
    name = f"{settings.queue}.capture"
    async with amqp.channel() as channel:
        await declare_topology(channel, settings, payments.routing_keys())
        queue = await channel.declare_queue(name, durable=False, auto_delete=False)
        await queue.bind(settings.exchange, "payment.settled")
    yield name
    async with amqp.channel() as channel:
        await channel.queue_delete(name)


@pytest.fixture
def expected_file(tmp_path: Path) -> Path:
    path = tmp_path / "expected.json"
    path.write_text(json.dumps(EXPECTED))
    return path


async def settle_payments(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    """Run ``PAYMENTS`` (one of them twice) through a worker until their notices are written
    and the outbox is empty, then stop the worker."""
    async with running_worker(settings, payments):
        channel = await amqp.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(settings.exchange)
        for body in [*PAYMENTS, PAYMENTS[0]]:
            await exchange.publish(
                aio_pika.Message(
                    json.dumps(body).encode(),
                    content_type="application/json",
                    headers={"idempotency-key": body["payment_id"]},
                ),
                routing_key="payment.requested",
            )
        await channel.close()

        async def quiet() -> bool:
            notices = await scalar(engine, "SELECT count(*) FROM settlement_notices")
            outbox = await scalar(engine, "SELECT count(*) FROM outbox")
            return bool(notices == len(PAYMENTS) and outbox == 0)

        await wait_until(quiet)


async def execute(engine: AsyncEngine, sql: str, **params: Any) -> None:
    async with engine.begin() as conn:
        await conn.execute(text(sql), params)


async def test_a_clean_run_passes_every_invariant_and_the_capture_queue_is_drained(
    settings: Settings,
    engine: AsyncEngine,
    amqp: AbstractRobustConnection,
    capture_queue: str,
    expected_file: Path,
) -> None:
    await settle_payments(settings, engine, amqp)

    result = await worker_verify(
        settings,
        "--quiet-queue",
        "--capture-queue",
        capture_queue,
        "--expect-balances",
        expected_file,
    )

    assert result.returncode == 0, result.stdout + result.stderr
    checks = results(result.stdout)
    assert set(checks) == WORKER_CHECKS | PAYMENTS_CHECKS | {
        "work-queue-empty",
        "expected-balances",
        "settled-events-delivered",
    }
    assert all(ok for ok, _ in checks.values()), result.stdout
    assert checks["balances-match-ledger"][1].startswith("3 account(s), 5 ledger entries")
    assert "5 payment.settled for 5 payment(s)" in checks["settled-events-delivered"][1]
    assert "0 consumer(s)" in checks["work-queue-empty"][1]
    # Draining is destructive: a second run finds none of the events it found the first time.
    again = await worker_verify(settings, "--capture-queue", capture_queue, "--json")
    assert again.returncode == 1
    report = json.loads(again.stdout)
    assert report["ok"] is False
    (delivered,) = [c for c in report["checks"] if c["name"] == "settled-events-delivered"]
    assert delivered["ok"] is False
    assert "5 of 5 settled payment(s) never delivered: p1, p2, p3, p4, p5" in delivered["detail"]
    assert {c["name"] for c in report["checks"] if not c["ok"]} == {"settled-events-delivered"}


@pytest.mark.parametrize(
    ("damage", "broken"),
    [
        pytest.param(
            "UPDATE accounts SET balance_cents = balance_cents + 1 WHERE account = 'bob'",
            {"balances-match-ledger", "expected-balances"},
            id="balance-off-by-one",
        ),
        pytest.param(
            "INSERT INTO inbox (handler, key, fingerprint, status, routing_key) "
            "VALUES ('payment.requested', 'p9', '\\x00', 'in_progress', 'payment.requested')",
            {"no-stuck-inbox-keys"},
            id="stuck-inbox-key",
        ),
        pytest.param(
            "INSERT INTO outbox (message_id, exchange, routing_key, body, content_type, "
            "created_at) VALUES (gen_random_uuid(), 'events', 'payment.settled', '\\x7b7d', "
            "'application/json', now() - interval '2 minutes')",
            {"outbox-drained"},
            id="old-outbox-row",
        ),
        pytest.param(
            "DELETE FROM settlement_notices WHERE payment_id = 'p3'",
            {"one-notice-per-settlement"},
            id="missing-notice",
        ),
    ],
)
async def test_damage_fails_the_invariant_that_guards_against_it(
    settings: Settings,
    engine: AsyncEngine,
    amqp: AbstractRobustConnection,
    expected_file: Path,
    damage: str,
    broken: set[str],
) -> None:
    await settle_payments(settings, engine, amqp)
    await execute(engine, damage)

    result = await worker_verify(settings, "--quiet-queue", "--expect-balances", expected_file)

    assert result.returncode == 1, result.stdout + result.stderr
    assert failed(result.stdout) == broken, result.stdout


async def test_failures_name_what_is_wrong(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    await settle_payments(settings, engine, amqp)
    await execute(engine, "UPDATE accounts SET balance_cents = 351 WHERE account = 'alice'")
    await execute(engine, "DELETE FROM settlement_notices WHERE payment_id = 'p4'")
    await execute(
        engine,
        "UPDATE settlement_notices SET amount_cents = 2 WHERE payment_id = 'p5'",
    )
    await execute(
        engine,
        "INSERT INTO outbox (message_id, exchange, routing_key, body, content_type, attempts, "
        "last_error, created_at) VALUES (gen_random_uuid(), 'events', 'payment.settled', "
        "'\\x7b7d', 'application/json', 3, 'unroutable: NO_ROUTE', now() - interval '2 min')",
    )

    checks = results((await worker_verify(settings)).stdout)

    assert checks["balances-match-ledger"] == (
        False,
        "1 of 3 account(s) differ from their ledger sums (5 entries): "
        "alice balance 351 != ledger 350",
    )
    notices = checks["one-notice-per-settlement"][1]
    assert "1 settlement(s) without a notice: p4" in notices
    assert "1 notice(s) with another account or amount than their entry: p5" in notices
    outbox = checks["outbox-drained"][1]
    assert outbox.startswith("1 of 1 row(s) waiting longer than 1m: id=")
    assert "attempts=3 last_error='unroutable: NO_ROUTE'" in outbox


async def run_checks(
    settings: Settings,
    engine: AsyncEngine,
    amqp: AbstractRobustConnection,
    **options: Any,
) -> dict[str, verify.Check]:
    checks = await verify.verify(
        settings, EXAMPLES, engine, amqp, verify.Options(**options), invariants=[]
    )
    return {check.name: check for check in checks}


async def test_a_live_workflow_is_fine_and_one_whose_lease_expired_long_ago_is_stuck(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    await execute(
        engine,
        "INSERT INTO inbox (handler, key, fingerprint, status, recovery_point, routing_key, "
        "owner, lease_until) VALUES "
        "('order.placed', 'live', '\\x00', 'in_progress', NULL, 'order.placed', 'd1', "
        "now() + interval '30 s'), "
        "('order.placed', 'released', '\\x00', 'in_progress', 'reserve_inventory', "
        "'order.placed', NULL, now() - interval '1 min'), "
        "('order.placed', 'dead', '\\x00', 'in_progress', 'charge_payment', 'order.placed', "
        "'d2', now() - interval '10 min')",
    )

    checks = await run_checks(settings, engine, amqp)
    patient = await run_checks(settings, engine, amqp, stuck_after=3600.0)

    assert checks["no-stuck-inbox-keys"].ok
    stuck = checks["no-stuck-workflows"]
    assert not stuck.ok
    assert stuck.detail.startswith("1 workflow(s) whose lease expired more than 5m ago: ")
    assert "order.placed/dead (recovery point charge_payment" in stuck.detail
    assert patient["no-stuck-workflows"].ok
    assert patient["no-stuck-workflows"].detail.startswith("3 key(s) in progress")


async def test_a_waiting_workflow_long_past_its_deadline_is_named_as_waiting(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given a workflow sleeping, whose lease and deadline passed an hour ago (moved in SQL)
    router = Router()

    @router.workflow("nap.requested")
    async def nap(body: dict[str, str], wf: Workflow) -> None:
        await wf.sleep("nap", timedelta(minutes=1))

    assert (await Harness(router, engine).deliver("nap.requested", {}, key="n1")).outcome == (
        "waiting"
    )
    await execute(engine, "UPDATE inbox SET lease_until = now() - interval '1 hour'")
    await execute(engine, "UPDATE workflow_waits SET due_at = now() - interval '1 hour'")
    due_at = await scalar(engine, "SELECT due_at FROM workflow_waits")

    # When the checks run
    checks = await run_checks(settings, engine, amqp)

    # Then it is stuck, named as a wait nothing resumed, not by the lease it released
    stuck = checks["no-stuck-workflows"]
    assert not stuck.ok
    assert stuck.detail == (
        "1 workflow(s) whose lease expired more than 5m ago: nap.requested/n1 (recovery point "
        f"-, waiting until {due_at.isoformat()}, not resumed: is a relay running, or was its "
        "timer cancelled?)"
    )


async def test_parked_outbox_rows_fail_unless_allowed(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    await execute(
        engine,
        "INSERT INTO outbox_parked (id, message_id, exchange, routing_key, body, content_type, "
        "headers, attempts, last_error, created_at) VALUES (7, gen_random_uuid(), 'events', "
        "'payment.settled', '\\x7b7d', 'application/json', '{}', 10, 'nacked', now())",
    )

    strict = await run_checks(settings, engine, amqp)
    lenient = await run_checks(settings, engine, amqp, allow_parked=True)

    assert not strict["outbox-nothing-parked"].ok
    assert strict["outbox-nothing-parked"].detail == (
        "1 parked outbox row(s): id=7 payment.settled last_error='nacked'"
    )
    assert lenient["outbox-nothing-parked"].ok
    assert strict["outbox-drained"].ok


async def test_queued_and_parked_messages(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    async with amqp.channel() as channel:
        topology = await declare_topology(channel, settings, payments.routing_keys())
        for reason in ("invalid", "invalid", "handler-error"):
            await topology.dead_letter_exchange.publish(
                aio_pika.Message(b"{}", headers={"x-worker-reason": reason}), routing_key="x"
            )
        await channel.default_exchange.publish(
            aio_pika.Message(b"{}"), routing_key=settings.retry_queue(settings.retry_delays[-1])
        )

    unasked = await run_checks(settings, engine, amqp)
    strict: dict[str, verify.Check] = {}

    async def retry_copy_seen() -> bool:
        # (while the broker moves an expired copy from the retry queue to the work queue, it
        # is counted in neither for a moment: ask again)
        strict.update(
            await run_checks(settings, engine, amqp, quiet_queue=True, no_dead_letters=True)
        )
        return not strict["work-queue-empty"].ok

    await wait_until(retry_copy_seen)

    assert "work-queue-empty" not in unasked
    # (made by hand, not by the worker: their x-worker-reason headers are claims)
    parked = f"3 message(s) in {settings.dead_letter_queue}: unverified=3"
    assert unasked["dead-letters"] == verify.Check("dead-letters", True, parked)
    assert strict["dead-letters"] == verify.Check("dead-letters", False, parked + " (none allowed)")
    # the retry copy returns to the work queue after its TTL: one of the two holds it
    assert not strict["work-queue-empty"].ok
    assert "has 1 ready" in strict["work-queue-empty"].detail
    # the DLQ was only looked at
    again = await run_checks(settings, engine, amqp)
    assert again["dead-letters"].detail == parked


async def test_the_quiet_queue_check_fails_on_queues_that_do_not_exist(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    checks = await run_checks(settings, engine, amqp, quiet_queue=True)

    assert not checks["work-queue-empty"].ok
    assert f"{settings.queue} does not exist" in checks["work-queue-empty"].detail
    assert checks["dead-letters"].ok


async def test_an_invariant_that_raises_is_a_failed_check_named_after_it(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    async def ledger_is_sound(deployment: verify.Deployment) -> verify.Check | None:
        raise RuntimeError("no such table")

    checks = await verify.verify(
        settings, EXAMPLES, engine, amqp, verify.Options(), invariants=[ledger_is_sound]
    )

    assert checks[-1] == verify.Check(
        "ledger-is-sound", False, "could not check: RuntimeError: no such table"
    )


def test_invariants_are_found_next_to_the_handler_modules() -> None:
    assert verify.load_invariants(["examples.payments"], include_installed=False) == list(
        payments_invariants.invariants
    )
    assert verify.load_invariants(["examples.orders"], include_installed=False) == []
    assert verify.load_invariants(["tests.integration.test_verify"], include_installed=False) == []


async def test_usage_errors_exit_2(settings: Settings, engine: AsyncEngine, tmp_path: Path) -> None:
    not_json = tmp_path / "balances.json"
    not_json.write_text("[1, 2]")

    missing = await worker_verify(settings, "--expect-balances", tmp_path / "none.json")
    malformed = await worker_verify(settings, "--expect-balances", not_json)
    no_reader = await worker_verify(settings, "--capture-queue", "q", WORKER_HANDLERS="")
    bad_age = await worker_verify(settings, "--stuck-after", "soon")

    for result in (missing, malformed, no_reader, bad_age):
        assert result.returncode == 2, result.stdout + result.stderr
    assert "cannot read expected balances" in missing.stderr
    assert "JSON object of account: integer cents" in malformed.stderr
    assert "no handler module declares any" in no_reader.stderr
    assert "--stuck-after" in bad_age.stderr


async def test_an_unreachable_database_fails_without_a_traceback(
    settings: Settings, engine: AsyncEngine
) -> None:
    result = await worker_verify(
        settings, WORKER_DATABASE_URL=f"postgresql://postgres:secret@127.0.0.1:1/{uuid.uuid4()}"
    )

    assert result.returncode == 3
    assert result.stdout.startswith("FAIL database: cannot reach PostgreSQL at postgresql://")
    assert "secret" not in result.stdout + result.stderr
    assert "Traceback" not in result.stderr
