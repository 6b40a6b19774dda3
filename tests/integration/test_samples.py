"""Process samples against the real services: a running worker and relay write them, with their
state (paused, draining, stopped), counters that grow as messages flow, and the backlogs they
see; old ones expire, and only they; ``worker status`` lists every process from them; each read
is an index range, however many samples the table holds."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import aio_pika
import pytest
from aio_pika import Message
from aio_pika.abc import AbstractRobustConnection
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from examples.payments import router as payments
from tests.helpers import payment, rows, scalar, wait_until
from tests.integration.support import (
    add_outbox_row,
    declare,
    publish,
    running_relay,
    running_worker,
    settled,
)
from tests.integration.test_admin import line, worker
from worker import Router
from worker.core.context import Context
from worker.database import create_engine
from worker.liveness import Liveness
from worker.ops import overview
from worker.ops import samples as sampling_module
from worker.ops.samples import SAMPLES_KEPT, Role, Sampler, State
from worker.settings import Settings
from worker.sql import samples
from worker.sql.samples import Gauge, NewSample
from worker.telemetry import Count
from worker.transport.connection import Observing

INTERVAL = 0.2
"""The tests' sample interval: a sample every 200 ms."""


def sampling(settings: Settings, **changes: Any) -> Settings:
    return settings.replace(sample_interval=INTERVAL, **changes)


async def samples_of(engine: AsyncEngine, role: str | None = None) -> list[Any]:
    """Every sample in the table (of ``role``), oldest first."""
    return await rows(
        engine,
        "SELECT process, role, state, reason, counters, gauges FROM process_samples "
        "WHERE role = coalesce(:role, role) ORDER BY id",
        role=role,
    )


async def until_sampled(engine: AsyncEngine, condition: str, **params: Any) -> None:
    """Wait until a sample matching the SQL ``condition`` exists."""

    async def written() -> bool:
        found = await scalar(
            engine, f"SELECT count(*) FROM process_samples WHERE {condition}", **params
        )
        return bool(found)

    await wait_until(written)


async def test_a_running_worker_writes_samples_whose_counters_grow_as_messages_flow(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given a running worker that samples itself every 200 ms, and an old outbox row
    settings = sampling(settings, relay=False)
    await add_outbox_row(engine, settings, age=30.0)
    async with running_worker(settings, payments) as running:
        await until_sampled(engine, "state = 'consuming'")

        # When payments flow
        channel = await amqp.channel(publisher_confirms=True)
        for n in range(3):
            await publish(channel, settings, payment(f"s-{n}"), key=f"s-{n}")
        await settled(running, processed=3)
        await until_sampled(engine, "(counters ->> 'processed')::int = 3")
        for n in range(3, 5):
            await publish(channel, settings, payment(f"s-{n}"), key=f"s-{n}")
        await settled(running, processed=5)
        await until_sampled(engine, "(counters ->> 'processed')::int = 5")

    # Then its samples, from its first (starting) to its last (stopped), are one process's
    written = await samples_of(engine)
    assert {row.process for row in written} == {written[0].process}
    assert {row.role for row in written} == {"worker"}
    assert written[0].state == State.STARTING
    assert written[-1].state == State.STOPPED
    assert State.CONSUMING in {row.state for row in written}
    # and its counters only grow, to the totals the process counted
    processed = [row.counters.get(Count.PROCESSED, 0) for row in written]
    assert processed == sorted(processed)
    assert processed[-1] == 5 == running.stats[Count.PROCESSED]
    assert written[-1].counters == dict(running.stats)
    # and a sample carries the backlogs the process saw: the outbox row, the empty queues
    gauges = written[-1].gauges
    assert gauges[Gauge.OUTBOX_BACKLOG] == 1
    assert gauges[Gauge.OUTBOX_OLDEST_AGE] >= 30
    assert gauges[Gauge.OUTBOX_BACKING_OFF] == 0
    assert gauges[Gauge.OUTBOX_PARKED] == 0
    assert gauges[Gauge.WORK_QUEUE] == 0
    assert gauges[Gauge.DEAD_LETTER_QUEUE] == 0
    assert gauges[Gauge.QUEUE_LAG] == 0  # (nothing waits)


def timestamped_router(entered: asyncio.Event, release: asyncio.Event) -> Router:
    """A handler of ``held`` that waits for ``release`` inside its transaction."""
    router = Router()

    @router.handler("held")
    async def held(body: str, ctx: Context) -> None:
        entered.set()
        await release.wait()

    return router


async def test_the_queue_lag_is_the_age_of_the_last_delivery_taken_while_messages_wait(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given a worker whose one handler holds its delivery, taking one message at a time
    entered, release = asyncio.Event(), asyncio.Event()
    settings = sampling(settings, relay=False, concurrency=1, batch_size=1, prefetch=1)
    async with running_worker(settings, timestamped_router(entered, release)):
        # When a message stamped 90 s ago is taken, and another waits behind it
        channel = await amqp.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(settings.exchange)
        stamped = datetime.now(UTC) - timedelta(seconds=90)
        for n in range(2):
            await exchange.publish(
                Message(b'"x"', timestamp=stamped, headers={"idempotency-key": f"lag-{n}"}),
                routing_key="held",
            )
        await asyncio.wait_for(entered.wait(), 20)

        # Then a sample says the head of the queue waited about that long
        await until_sampled(engine, "(gauges ->> 'queue_lag_seconds')::float >= 89")
        lag = await scalar(
            engine,
            "SELECT (gauges ->> 'queue_lag_seconds')::float FROM process_samples "
            "WHERE gauges ->> 'queue_lag_seconds' IS NOT NULL ORDER BY id DESC LIMIT 1",
        )
        assert 89 <= lag < 150
        release.set()


def deployment_router() -> Router:
    """A handler of ``broken.deploy`` whose table is missing: the deployment's fault."""
    router = Router()

    @router.handler("broken.deploy")
    async def broken(body: str, ctx: Context) -> None:
        await ctx.connection.execute(text("SELECT 1 FROM no_such_table_of_samples"))

    return router


async def test_a_worker_paused_by_its_deployment_says_so_and_why_in_its_samples(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given a running worker whose handler's table does not exist
    settings = sampling(settings, relay=False)
    async with running_worker(settings, deployment_router()) as running:
        # When a message for it arrives
        channel = await amqp.channel(publisher_confirms=True)
        await publish(channel, settings, "x", key="d-1", routing_key="broken.deploy")
        await settled(running, paused=1)

        # Then a sample says it is paused, because of the deployment, and what is missing
        await until_sampled(engine, "state = 'paused'")
    (reason,) = {row.reason for row in await samples_of(engine) if row.state == State.PAUSED}
    assert reason.startswith("deployment: ")
    assert "no_such_table_of_samples" in reason


async def test_a_draining_worker_says_so_and_its_last_sample_says_stopped(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given a running worker whose handler holds a delivery in its transaction
    entered, release = asyncio.Event(), asyncio.Event()
    settings = sampling(settings, relay=False)
    async with running_worker(settings, timestamped_router(entered, release)) as running:
        channel = await amqp.channel(publisher_confirms=True)
        await publish(channel, settings, "x", key="drain-1", routing_key="held")
        await asyncio.wait_for(entered.wait(), 20)

        # When it is told to stop, while the delivery is in flight
        running.stop.set()

        # Then it says it drains, while it waits for that delivery
        await until_sampled(engine, "state = 'draining'")
        assert not running.task.done()

        # And once the delivery commits and the worker stops, its last sample says stopped
        release.set()
        await running.shutdown()
    states = [row.state for row in await samples_of(engine)]
    assert states[-1] == State.STOPPED
    assert states.count(State.STOPPED) == 1
    assert State.DRAINING in states[states.index(State.CONSUMING) :]


def a_sample(process: str, state: str = "consuming", **counters: int) -> NewSample:
    return NewSample(
        process=process,
        role="worker",
        host="h",
        pid=1,
        started_at=None,
        state=state,
        reason=None,
        counters=counters,
        gauges={Gauge.WORK_QUEUE: 0},
    )


async def insert(engine: AsyncEngine, *written: NewSample) -> None:
    async with engine.begin() as conn:
        for sample in written:
            await samples.insert_sample(conn, sample)


async def age(engine: AsyncEngine, process: str, seconds: float) -> None:
    """Move ``process``'s samples ``seconds`` into the past (no sleeping)."""
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "UPDATE process_samples SET sampled_at = sampled_at - make_interval(secs => :s), "
                "started_at = started_at - make_interval(secs => :s) WHERE process = :p"
            ),
            {"s": seconds, "p": process},
        )


async def test_expiry_deletes_only_samples_older_than_kept_and_at_most_a_batch(
    engine: AsyncEngine,
) -> None:
    # Given 5 samples older than SAMPLES_KEPT and 2 just younger
    await insert(engine, *(a_sample("old") for _ in range(5)), *(a_sample("young"),) * 2)
    await age(engine, "old", SAMPLES_KEPT + 60)
    await age(engine, "young", SAMPLES_KEPT - 60)

    # When expiry runs with a batch of 3, then again
    async with engine.begin() as conn:
        first = await samples.expire_samples(conn, kept=SAMPLES_KEPT, limit=3)
    async with engine.begin() as conn:
        second = await samples.expire_samples(conn, kept=SAMPLES_KEPT, limit=3)

    # Then it deleted the old ones, 3 then 2, and left the young ones
    assert (first, second) == (3, 2)
    assert await scalar(
        engine, "SELECT string_agg(DISTINCT process, ',') FROM process_samples"
    ) == ("young")
    assert await scalar(engine, "SELECT count(*) FROM process_samples") == 2


async def test_a_worker_s_write_expires_old_samples(
    settings: Settings, engine: AsyncEngine
) -> None:
    # Given a sample of a process long gone
    await insert(engine, a_sample("gone"))
    await age(engine, "gone", SAMPLES_KEPT + 1)

    # When a worker runs and samples itself
    async with running_worker(sampling(settings, relay=False), payments):
        await until_sampled(engine, "state = 'consuming'")

        # Then the old sample is gone
        assert (
            await scalar(engine, "SELECT count(*) FROM process_samples WHERE process='gone'") == 0
        )


async def test_rates_come_from_counter_differences_and_old_processes_are_not_listed(
    engine: AsyncEngine,
) -> None:
    # Given a process with a sample 50 s ago and one now, 100 processed between them,
    # and a process last seen 10 minutes ago
    await insert(engine, a_sample("busy", processed=20, dead_lettered=1))
    await age(engine, "busy", 50)
    await insert(engine, a_sample("busy", processed=120, dead_lettered=6, retry_scheduled=4))
    await insert(engine, a_sample("gone"))
    await age(engine, "gone", 600)

    # When the processes are read by a reader sampling every 10 s
    async with engine.connect() as conn:
        (view,) = await overview.read_processes(conn, interval=10)

    # Then the busy one is listed, at 2 processed/s and 0.2 failed/s; the old one is not
    assert view.process == "busy"
    assert view.reported_seconds_ago < 5
    assert view.rates.processed is not None
    assert abs(view.rates.processed - 2.0) < 0.05
    assert view.rates.failures is not None
    assert abs(view.rates.failures - 0.18) < 0.01


async def test_status_lists_a_worker_and_a_relay_from_their_samples(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given a worker and a relay, each its own process, sampling themselves
    settings = sampling(settings, relay=False)
    await declare(amqp, settings)
    async with running_worker(settings, payments), running_relay(settings):
        await until_sampled(engine, "role = 'worker' AND state = 'consuming'")
        await until_sampled(engine, "role = 'relay' AND state = 'relaying'")

        # When an operator asks for the status, as text and as JSON
        env = {"WORKER_SAMPLE_INTERVAL": "1s"}
        shown = await worker(settings, "status", **env)
        as_json = await worker(settings, "status", "--json", **env)

    # Then both are listed: role, host and pid, state, when they reported, their rate
    assert shown.returncode == 0, shown.stderr
    assert line(shown.stdout, "processes") == "2 reported in the last 3s"
    listed = [text for text in shown.stdout.splitlines() if text.startswith(("worker ", "relay "))]
    assert len(listed) == 2, shown.stdout
    by_role = {text.split()[0]: text for text in listed}
    assert "consuming; reported " in by_role["worker"]
    assert " processed/s; up " in by_role["worker"]
    assert "relaying; reported " in by_role["relay"]
    assert " published/s; up " in by_role["relay"]
    processes = json.loads(as_json.stdout)["processes"]
    assert sorted(p["role"] for p in processes) == ["relay", "worker"]
    assert {p["state"] for p in processes} == {"consuming", "relaying"}
    assert all(p["reported_seconds_ago"] < 3 for p in processes)


async def test_status_says_when_no_process_reports(settings: Settings) -> None:
    result = await worker(settings, "status")

    assert result.returncode == 0, result.stderr
    assert line(result.stdout, "processes") == "none reported in the last 30s (see sample_interval)"


# Every read is an index range, however many samples the table holds.

MANY = 20_000


async def plan(engine: AsyncEngine, statement: Any) -> str:
    """PostgreSQL's plan of the SQLAlchemy ``statement`` (its parameters inlined)."""
    async with engine.connect() as conn:
        compiled = statement.compile(dialect=conn.dialect, compile_kwargs={"literal_binds": True})
        found = await conn.execute(text(f"EXPLAIN {compiled}"))
        return "\n".join(row[0] for row in found)


async def test_every_read_and_the_expiry_use_an_index_on_a_large_table(
    engine: AsyncEngine,
) -> None:
    # Given 20,000 samples of 20 processes over the last two hours, analyzed
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "INSERT INTO process_samples (process, role, host, pid, started_at, sampled_at, "
                "state, counters, gauges) SELECT 'p' || (n % 20), 'worker', 'h', n % 20, "
                "now() - interval '3 hours', now() - make_interval(secs => n * 0.36), "
                "'consuming', jsonb_build_object('processed', n), "
                "jsonb_build_object('work_queue_ready', 0) FROM generate_series(1, :many) AS n"
            ),
            {"many": MANY},
        )
        await conn.execute(text("ANALYZE process_samples"))

    # When each statement is explained
    plans = {
        "latest": await plan(engine, samples.latest_query(within=30)),
        "oldest": await plan(engine, samples.latest_query(within=60, newest=False)),
        "series": await plan(
            engine,
            samples.series_query(
                within=3600, per_process=362, counters=["processed"], gauges=["work_queue_ready"]
            ),
        ),
        "expire": await plan(engine, samples.expiry(kept=SAMPLES_KEPT - 600, limit=1000)),
    }

    # Then none scans the table: each reads the index that bounds it
    for name, found in plans.items():
        assert "Seq Scan on process_samples" not in found, f"{name}:\n{found}"
    assert "Index Scan using ix_process_samples_sampled_at" in plans["latest"]
    assert "Index Scan using ix_process_samples_sampled_at" in plans["oldest"]
    assert "Index Scan Backward using ix_process_samples_process_sampled_at" in plans["series"]
    assert "Index Scan using ix_process_samples_sampled_at" in plans["expire"]
    assert "Index Scan using pk_process_samples" in plans["expire"]

    # And the series reads at most its bound of rows per process
    async with engine.connect() as conn:
        points = await samples.series(conn, within=3600, per_process=50, counters=["processed"])
    per_process = {p.process: 0 for p in points}
    for point in points:
        per_process[point.process] += 1
    assert len(per_process) == 20
    assert set(per_process.values()) == {50}


async def test_the_history_sums_rates_over_processes_and_takes_the_largest_backlog(
    engine: AsyncEngine,
) -> None:
    # Given two processes sampled 30 s apart in the last two minutes, each processing 3/s,
    # one of them seeing a work queue of 7, the other of 5
    async with engine.begin() as conn:  # (one transaction: one now())
        for process, ready in (("a", 7), ("b", 5)):
            for back, processed in ((90, 0), (60, 90), (30, 180)):
                written = a_sample(process, processed=processed)
                await samples.insert_sample(
                    conn, replace(written, gauges={Gauge.WORK_QUEUE: ready})
                )
                await conn.execute(
                    text(
                        "UPDATE process_samples SET sampled_at = now() - make_interval(secs => :b)"
                        " WHERE id = (SELECT max(id) FROM process_samples)"
                    ),
                    {"b": back},
                )

    # When the history of the last 2 minutes is read in 4 buckets of 30 s
    found = await overview.history(engine, window=120, points=4, interval=30)

    # Then the throughput is 6/s where both processes have two samples, the backlog the larger
    assert found.bucket_seconds == 30
    assert found.processed == (None, pytest.approx(6.0), pytest.approx(6.0), None)
    assert found.failures == (None, 0.0, 0.0, None)
    assert found.work_queue[:3] == (7.0, 7.0, 7.0)
    assert found.outbox_backlog == (None, None, None, None)


async def test_the_overview_shows_the_processes_queues_lag_and_outbox_as_they_are(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given a running worker, an outbox row waiting for a minute, and a message it dead-letters
    settings = sampling(settings, relay=False)
    await add_outbox_row(engine, settings, age=60.0)
    async with running_worker(settings, payments) as running:
        channel = await amqp.channel(publisher_confirms=True)
        await publish(channel, settings, payment("o-1"), key="o-1")
        await publish(channel, settings, {"payment_id": "bad"}, key="o-bad")
        await settled(running, processed=1, dead_lettered=1)
        await until_sampled(engine, "(counters ->> 'dead_lettered')::int = 1")
        await until_sampled(engine, "(gauges ->> 'dead_letter_queue_ready')::int = 1")

        # When the overview is read
        seen = await overview.overview(engine, amqp, settings)
        history = await overview.history(engine, window=60, points=12, interval=INTERVAL)

    # Then it shows the worker, consuming, and the queues as the broker counts them
    assert seen.errors == {}
    (process,) = seen.processes
    assert (process.role, process.state, process.reason) == ("worker", "consuming", None)
    assert seen.work_queue == overview.QueueView(settings.queue, True, 0, 1)
    assert seen.dead_letter_queue == overview.QueueView(settings.dead_letter_queue, True, 1, 0)
    assert seen.queue_lag_seconds == 0  # nothing waits
    # and the outbox as the worker's last sample saw it
    assert seen.outbox is not None
    assert (seen.outbox.pending, seen.outbox.backing_off, seen.outbox.parked) == (1, 0, 0)
    assert seen.outbox.oldest_age_seconds is not None
    assert seen.outbox.oldest_age_seconds >= 60
    assert seen.outbox.process == process.process
    # and the last minute's history saw the payment processed and the dead letter
    assert any(rate for rate in history.processed if rate)
    assert any(rate for rate in history.failures if rate)
    assert 1.0 in history.outbox_backlog


async def test_the_overview_shows_the_database_s_part_when_the_broker_cannot_be_read(
    settings: Settings, engine: AsyncEngine
) -> None:
    # Given a process's sample, and a broker connection that is closed
    await insert(engine, a_sample("p"))
    closed = await aio_pika.connect(settings.amqp_url)
    await closed.close()

    # When the overview is read through it
    seen = await overview.overview(engine, closed, settings)

    # Then the processes are there, the queues unknown, and the error says why
    assert [p.process for p in seen.processes] == ["p"]
    assert (seen.work_queue, seen.dead_letter_queue) == (None, None)
    assert set(seen.errors) == {"broker"}


async def test_a_relay_alone_reports_missing_queues_as_null_and_declares_none(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given no worker ever declared the queues, and a relay alone running
    async with running_relay(sampling(settings)):
        # When it has written a few samples
        await until_sampled(engine, "state = 'relaying'")
        await until_sampled(
            engine, "role = 'relay' AND id >= (SELECT min(id) + 5 FROM process_samples)"
        )

    # Then its samples hold no count for the queues, and the queues still do not exist
    written = await samples_of(engine, "relay")
    assert {row.gauges[Gauge.WORK_QUEUE] for row in written} == {None}
    assert {row.gauges[Gauge.DEAD_LETTER_QUEUE] for row in written} == {None}
    assert {row.gauges[Gauge.QUEUE_LAG] for row in written} == {None}
    for queue in (settings.queue, settings.dead_letter_queue):
        channel = await amqp.channel()
        with pytest.raises(aio_pika.exceptions.ChannelNotFoundEntity):
            await channel.declare_queue(queue, passive=True)


async def test_a_write_that_fails_is_logged_once_and_skipped(
    settings: Settings, amqp: AbstractRobustConnection, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a sampler whose database cannot be reached
    unreachable = settings.replace(database_url="postgresql://postgres@127.0.0.1:1/nowhere")
    engine = create_engine(unreachable, application_name="test-samples", pool_size=1)
    broker = Observing(settings.amqp_url, "test-observer", Liveness.of(settings))
    sampler = Sampler(settings, engine, broker, Counter(), role=Role.RELAY, outbox=lambda: None)
    try:
        # When it samples three times
        for _ in range(3):
            await sampler.sample()
    finally:
        await broker.close()
        await engine.dispose()

    # Then nothing was raised, and one warning says why
    warned = [r for r in caplog.records if "could not write a sample" in r.getMessage()]
    assert [r.levelname for r in warned] == ["WARNING"]


async def test_queue_counts_cut_short_by_their_timeout_never_cost_the_consumer_its_connection(
    settings: Settings,
    engine: AsyncEngine,
    amqp: AbstractRobustConnection,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given a worker that samples itself every 2 ms, each count of its queues given from 0.1 to
    # 3 ms (swept): most are cut short, some in the middle of a channel's open or close
    monkeypatch.setattr(sampling_module, "QUEUE_TIMEOUT", 0.001)
    settings = settings.replace(sample_interval=0.002, relay=False)

    async def sweep() -> None:
        while True:
            for tenths in range(1, 31):
                sampling_module.QUEUE_TIMEOUT = tenths / 10_000
                await asyncio.sleep(0.003)

    sweeping = asyncio.create_task(sweep())
    async with running_worker(settings, payments) as running:
        # When 200 payments flow meanwhile
        channel = await amqp.channel(publisher_confirms=True)
        for n in range(200):
            await publish(channel, settings, payment(f"c-{n}"), key=f"c-{n}")
        await settled(running, processed=200)
        await asyncio.sleep(2.0)  # (more counts cut short while the worker idles)
    sweeping.cancel()

    # Then the consumer's connection was never lost, and no payment came back as a duplicate
    lost = [
        r.args
        for r in caplog.records
        if r.name == "worker.transport.connection" and "lost" in str(r.msg)
    ]
    assert not [args for args in lost if isinstance(args, tuple) and args[0] == "worker"], lost
    assert running.stats[Count.PROCESSED] == 200
    assert running.stats[Count.DUPLICATE] == 0
