"""``Event.to_outbox``: the defaults and checks shared by ``ctx.publish`` and
``worker.outbox.publish``, and the validation of a schedule (``delay=`` / ``at=``), as tables."""

from __future__ import annotations

import uuid
from datetime import UTC, date, datetime, timedelta, timezone, tzinfo
from typing import Any

import pytest

from worker.core.events import MAX_DELAY, Event, due

ID = uuid.UUID(int=7)


def test_defaults_of_an_event() -> None:
    row = Event("a.b", {"x": 1}, message_id=ID).to_outbox("events")
    assert (row.exchange, row.routing_key, row.body) == ("events", "a.b", b'{"x":1}')
    assert row.content_type == "application/json"
    assert row.headers == {}  # (a consumer keys it by its message id)
    keyed = Event("a.b", {"x": 1}, message_id=ID).to_outbox("events", keyed=True)
    assert keyed.headers == {"idempotency-key": str(ID)}
    assert (row.correlation_id, row.causation_id, row.ordering_key) == (None, None, None)


@pytest.mark.parametrize(
    ("event", "key"),
    [
        (Event("a", {}, key="k1", message_id=ID), "k1"),
        (Event("a", {}, headers={"idempotency-key": "h1"}, message_id=ID), "h1"),
        (Event("a", {}, key="k1", headers={"idempotency-key": "h1"}), "k1"),
    ],
)
def test_the_idempotency_key_is_key_then_the_header_then_the_message_id(
    event: Event, key: str
) -> None:
    assert event.to_outbox("events").headers["idempotency-key"] == key


def test_the_events_own_correlation_id_and_exchange_win() -> None:
    row = Event("a", {}, exchange="", correlation_id="mine").to_outbox(
        "events", causation_id="in-1", correlation_id="inherited"
    )
    assert (row.exchange, row.correlation_id, row.causation_id) == ("", "mine", "in-1")
    inherited = Event("a", {}).to_outbox("events", correlation_id="inherited")
    assert inherited.correlation_id == "inherited"


@pytest.mark.parametrize(
    "fields",
    [
        {"routing_key": "é" * 128},  # 256 bytes
        {"routing_key": ""},
        {"routing_key": 5},
        {"exchange": "x" * 256},
        {"key": ""},
        {"key": "k" * 513},
        {"ordering_key": "a\x00"},
        {"correlation_id": "c" * 513},
        {"message_id": "not-a-uuid"},
        {"body": {"what": object()}},
        {"headers": {"h": object()}},
        {"content_type": "a\x00"},
    ],
)
def test_what_could_never_be_published_is_refused(fields: dict[str, Any]) -> None:
    event: dict[str, Any] = {"routing_key": "a.b", "body": {}, **fields}
    with pytest.raises((ValueError, TypeError)):
        Event(**event).to_outbox("events")


class NoOffset(tzinfo):
    """A timezone that cannot say its offset: a datetime carrying it is naive."""

    def utcoffset(self, dt: datetime | None) -> timedelta | None:
        return None


AT = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)


@pytest.mark.parametrize(
    ("fields", "due_in", "due_at"),
    [
        ({}, None, None),
        ({"delay": timedelta(minutes=30)}, 1800.0, None),
        ({"delay": timedelta(0)}, 0.0, None),
        ({"delay": timedelta(milliseconds=250)}, 0.25, None),
        ({"delay": MAX_DELAY}, MAX_DELAY.total_seconds(), None),
        ({"at": AT}, None, AT),
        ({"at": AT.astimezone(timezone(timedelta(hours=-5)))}, None, AT),
    ],
)
def test_delay_and_at_become_the_rows_due_fields(
    fields: dict[str, Any], due_in: float | None, due_at: datetime | None
) -> None:
    # Given an event with (or without) a delay or an instant
    row = Event("a.b", {}, **fields).to_outbox("events")

    # Then the row carries seconds from the transaction's start, or the aware instant
    assert (row.due_in, row.due_at) == (due_in, due_at)
    assert row.scheduled is (due_in is not None or due_at is not None)


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"delay": timedelta(seconds=1), "at": AT}, ValueError),
        ({"delay": timedelta(0), "at": AT}, ValueError),
        ({"at": datetime(2030, 1, 2, 3, 4, 5)}, ValueError),  # naive
        ({"at": datetime(2030, 1, 2, tzinfo=NoOffset())}, ValueError),
        ({"delay": timedelta(microseconds=-1)}, ValueError),
        ({"delay": MAX_DELAY + timedelta(microseconds=1)}, ValueError),
        ({"delay": timedelta.max}, ValueError),
        ({"delay": 30}, TypeError),
        ({"delay": 1.5}, TypeError),
        ({"delay": "PT30M"}, TypeError),
        ({"at": "2030-01-02T03:04:05+00:00"}, TypeError),
        ({"at": 1_900_000_000}, TypeError),
        ({"at": date(2030, 1, 2)}, TypeError),
    ],
)
def test_a_schedule_that_means_nothing_is_refused_before_anything_is_written(
    fields: dict[str, Any], error: type[Exception]
) -> None:
    # When an event is scheduled with both keywords, a naive instant, a negative or absurd
    # delay, or something that is not a timedelta / datetime
    # Then it is refused, as the publish calls refuse it
    with pytest.raises(error):
        Event("a.b", {}, **fields).to_outbox("events")
    with pytest.raises(error):
        due(fields.get("delay"), fields.get("at"))
