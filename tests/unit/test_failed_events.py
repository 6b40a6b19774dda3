"""``FailedEvents``: every failed publish counted, each route's logged at once and then summed up
once per interval, never one line per row."""

from __future__ import annotations

import logging

import pytest

from worker.transport.failed_events import FailedEvents

UNROUTABLE = "returned as unroutable: no queue is bound to exchange 'events' for routing key 'a'"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_routes_failures_are_one_line_at_once_then_one_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    failures = FailedEvents(logging.getLogger("test.relay"), interval=60.0, clock=clock)
    with caplog.at_level(logging.WARNING, "test.relay"):
        # When 500 events of one route fail within the interval, 100 of them parked
        for n in range(500):
            failures.record(("events", "a"), UNROUTABLE, parked=n % 5 == 0)
            failures.flush()
        assert len(caplog.records) == 1
        assert "bind a queue" in caplog.records[0].getMessage()
        assert "`worker outbox list --routing-key a` shows" in caplog.records[0].getMessage()
        assert "`worker outbox retry --routing-key a` publishes" in caplog.records[0].getMessage()

        # Then once the interval has passed, one line sums up the rest
        clock.now = 61.0
        failures.flush()
    assert len(caplog.records) == 2
    summary = caplog.records[1].getMessage()
    assert summary.startswith("499 more events for routing key 'a' on exchange 'events'")
    assert "99 of them parked" in summary


def test_routes_are_summed_up_apart_and_a_forced_flush_logs_what_is_left(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    failures = FailedEvents(logging.getLogger("test.relay"), interval=60.0, clock=clock)
    with caplog.at_level(logging.WARNING, "test.relay"):
        for route in (("events", "a"), ("events", "b"), ("events", "a"), ("other", "a")):
            failures.record(route, "nacked by the broker", parked=False)
        failures.flush(force=True)
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 4  # three first lines, one summary (the second of events/a)
    assert messages[3].startswith("1 more events for routing key 'a' on exchange 'events'")

    # And a route with nothing more to say after its first line logs no summary
    caplog.clear()
    with caplog.at_level(logging.WARNING, "test.relay"):
        failures.record(("events", "c"), "nacked", parked=True)
        clock.now = 120.0
        failures.flush()
    assert len(caplog.records) == 1


def test_the_unroutable_warning_names_a_command_a_shell_can_run_as_it_is(
    caplog: pytest.LogCaptureFixture,
) -> None:
    failures = FailedEvents(logging.getLogger("test.relay"), clock=Clock())
    with caplog.at_level(logging.WARNING, "test.relay"):
        failures.record(("events", "stock changed;x"), UNROUTABLE, parked=False)
    message = caplog.records[0].getMessage()
    assert "`worker outbox list --routing-key 'stock changed;x'` shows the events" in message
