"""``Event.to_outbox``: the defaults and checks shared by ``ctx.publish`` and
``worker.outbox.publish``, as a table."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from worker.core.events import Event

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
