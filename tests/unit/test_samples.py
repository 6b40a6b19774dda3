"""The arithmetic of process samples as tables, no services: a process's state from its facts,
rates from counter differences (a counter that restarted counts from 0), the head of the queue's
timestamp, the freshest sample's outbox and lag, and an hour's chart in buckets."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pamqp.commands import Basic

from worker.ops.overview import (
    Rates,
    bucketed,
    increase,
    outbox_view,
    process_views,
    queue_lag,
    rate,
)
from worker.ops.samples import THROTTLED_BECAUSE, State, newest_timestamp, state_of
from worker.sql.samples import Gauge, Point, Sample
from worker.telemetry import Count
from worker.transport.deliveries import Received


@pytest.mark.parametrize(
    ("before", "after", "grown"),
    [
        (10, 25, 15),  # it grew
        (10, 10, 0),  # it did not
        (100, 30, 30),  # it restarted from 0: all of it is new
        (0, 0, 0),
        (None, 5, None),  # unknown before
        (5, None, None),  # unknown after
    ],
)
def test_a_counter_s_increase(
    before: float | None, after: float | None, grown: float | None
) -> None:
    assert increase(before, after) == grown


@pytest.mark.parametrize(
    ("before", "after", "seconds", "per_second"),
    [
        (0, 120, 60.0, 2.0),
        (50, 50, 10.0, 0.0),
        (500, 60, 30.0, 2.0),  # a restart: the 60 since, not -440
        (1, 2, 0.0, None),  # no time between: one sample
        (1, 2, -1.0, None),
        (None, 2, 10.0, None),
    ],
)
def test_a_rate(
    before: float | None, after: float | None, seconds: float, per_second: float | None
) -> None:
    assert rate(before, after, seconds) == per_second


FACTS: dict[str, Any] = {
    "running": True,
    "draining": False,
    "stopped": False,
    "condition": {"throttled": False},
    "attached": True,
}


@pytest.mark.parametrize(
    ("changes", "state", "reason"),
    [
        ({}, State.CONSUMING, None),
        ({"running": False, "attached": False}, State.STARTING, None),
        (
            {"condition": {"throttled": False, "paused": "deployment", "paused_because": "x"}},
            State.PAUSED,
            "deployment: x",
        ),
        (
            {"condition": {"throttled": True, "paused": "database-unreachable"}},
            State.PAUSED,  # paused wins: it takes nothing at all
            "database-unreachable",
        ),
        ({"condition": {"throttled": True}}, State.THROTTLED, THROTTLED_BECAUSE),
        ({"attached": False}, State.DISCONNECTED, None),
        ({"condition": None, "attached": False}, State.RELAYING, None),
        ({"condition": None, "running": False, "attached": False}, State.STARTING, None),
        ({"draining": True, "condition": {"throttled": True}}, State.DRAINING, None),
        ({"draining": True, "stopped": True}, State.STOPPED, None),
        ({"stopped": True, "failed": True}, State.STOPPED, "a component failed (see its log)"),
    ],
)
def test_a_process_s_state(changes: dict[str, Any], state: State, reason: str | None) -> None:
    found = state_of(**(FACTS | changes))
    assert found[0] is state
    if state is State.DISCONNECTED:
        assert found[1] is not None
        assert "broker connection" in found[1]
    else:
        assert found[1] == reason


def received(timestamp: object) -> Received:
    return Received(
        body=b"",
        properties=Basic.Properties(timestamp=timestamp),  # type: ignore[arg-type]
        delivery_tag=1,
        redelivered=False,
        exchange="",
        routing_key="r",
        channel=None,  # type: ignore[arg-type]
    )


NOON = datetime(2026, 11, 26, 12, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("stamps", "newest"),
    [
        ([], None),
        ([None, None], None),
        ([NOON - timedelta(seconds=5), NOON], NOON),
        ([NOON, None], NOON),  # the last one that carries one
        ([NOON.replace(tzinfo=None)], NOON),  # naive: taken as UTC
        (["yesterday", 12], None),  # not a datetime: ignored
    ],
)
def test_the_head_s_timestamp_is_the_last_taken_that_carries_one(
    stamps: list[object], newest: datetime | None
) -> None:
    assert newest_timestamp([received(stamp) for stamp in stamps]) == newest


def sample(
    process: str,
    age: float,
    role: str = "worker",
    counters: dict[str, int] | None = None,
    **gauges: float | None,
) -> Sample:
    return Sample(
        process=process,
        role=role,
        host="h",
        pid=1,
        age_seconds=age,
        up_seconds=600.0,
        state="consuming",
        reason=None,
        counters=counters or {},
        gauges=dict(gauges),
    )


def test_rates_are_counter_differences_over_the_time_between_two_samples() -> None:
    newest = [
        sample("a", 1.0, counters={Count.PROCESSED: 130, Count.DEAD_LETTERED: 4}),
        sample("r", 2.0, "relay", counters={Count.RELAY_PUBLISHED: 10}),
        sample("new", 0.5, counters={Count.PROCESSED: 3}),
        sample("restarted", 1.0, counters={Count.PROCESSED: 20}),
    ]
    oldest = [
        sample("a", 51.0, counters={Count.PROCESSED: 30, Count.RETRY_SCHEDULED: 1}),
        sample("r", 22.0, "relay", counters={}),
        sample("new", 0.5, counters={Count.PROCESSED: 3}),  # its only sample
        sample("restarted", 41.0, counters={Count.PROCESSED: 900}),
    ]

    rates = {view.process: view.rates for view in process_views(newest, oldest)}

    assert rates["a"] == Rates(processed=2.0, failures=0.06, published=0.0)
    assert rates["r"] == Rates(processed=0.0, failures=0.0, published=0.5)
    assert rates["new"] == Rates(None, None, None)
    assert rates["restarted"].processed == 0.5
    assert process_views(newest[:1], [])[0].rates == Rates(None, None, None)


def test_the_outbox_and_the_lag_are_the_freshest_sample_s_that_saw_them() -> None:
    outbox = {
        Gauge.OUTBOX_BACKLOG: 3,
        Gauge.OUTBOX_OLDEST_AGE: 12.5,
        Gauge.OUTBOX_BACKING_OFF: 1,
        Gauge.OUTBOX_PARKED: 2,
        Gauge.OUTBOX_SCHEDULED: 7,
    }
    newest = [
        sample("stale", 9.0, **outbox, queue_lag_seconds=40.0),
        sample("fresh", 1.0, **(outbox | {Gauge.OUTBOX_BACKLOG: 0}), queue_lag_seconds=0.0),
        sample("blind", 0.1, outbox_backlog=None, queue_lag_seconds=None),  # its read failed
        sample("relay", 0.2, "relay", **outbox),
    ]

    seen = outbox_view(newest)
    assert seen is not None
    assert (seen.process, seen.pending, seen.oldest_age_seconds) == ("relay", 3, 12.5)
    assert (seen.backing_off, seen.parked, seen.scheduled, seen.as_of_seconds) == (1, 2, 7, 0.2)
    empty = outbox_view(newest[1:3])
    assert empty is not None
    assert empty.oldest_age_seconds is None  # nothing waits: no oldest
    assert outbox_view(newest[2:3]) is None
    assert queue_lag(newest) == 0.0  # the fresh worker's; the relay measures none
    assert queue_lag(newest[2:]) is None


def point(process: str, age: float, processed: float | None = None, **values: float) -> Point:
    return Point(process, age, {Count.PROCESSED: processed, **values})


@pytest.mark.parametrize(
    ("found", "processed", "work_queue"),
    [
        ([], (None, None, None), (None, None, None)),
        # one process, 10 s apart: 1/s in the buckets where a pair ends
        (
            [point("a", 25, 0), point("a", 15, 10), point("a", 5, 20)],
            (None, 1.0, 1.0),
            (None, None, None),
        ),
        # two processes at once: summed
        (
            [
                point("a", 15, 0),
                point("a", 5, 10),
                point("b", 15, 100),
                point("b", 5, 130),
            ],
            (None, None, 4.0),
            (None, None, None),
        ),
        # a restart (the counter went down) counts what it counted since
        ([point("a", 15, 50), point("a", 5, 4)], (None, None, 0.4), (None, None, None)),
        # a sample older than the window starts a pair, and counts nowhere itself
        ([point("a", 45, 0), point("a", 25, 40)], (2.0, None, None), (None, None, None)),
        # a backlog is the largest any process saw in the bucket, its newest value there
        (
            [
                point("a", 8, work_queue_ready=5),
                point("a", 2, work_queue_ready=3),
                point("b", 4, work_queue_ready=4),
            ],
            (None, None, 0.0),
            (None, None, 4.0),
        ),
        # a counter never counted is 0
        ([point("a", 15), point("a", 5)], (None, None, 0.0), (None, None, None)),
    ],
)
def test_an_hour_in_buckets(
    found: list[Point],
    processed: tuple[float | None, ...],
    work_queue: tuple[float | None, ...],
) -> None:
    history = bucketed(found, window=30, buckets=3)

    assert history.bucket_seconds == 10
    assert history.processed == pytest.approx(processed)
    assert history.work_queue == work_queue
    assert len(history.failures) == len(history.outbox_backlog) == 3
