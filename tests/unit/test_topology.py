"""The arguments each of the worker's queues is declared with, by ``queue_type``: classic queues
exactly as every earlier version declared them (so existing queues redeclare), quorum queues
replicated, dead-lettering at least once, with the delivery limit on the work queue."""

from __future__ import annotations

import pytest

from worker.errors import ConfigurationError
from worker.settings import Settings
from worker.transport.topology import queue_arguments

CLASSIC = Settings(queue="w", retry_delays=(1.0, 60.0))


def test_classic_queues_keep_the_arguments_they_always_had() -> None:
    assert queue_arguments(CLASSIC) == {
        "w": {"x-dead-letter-exchange": "w.dlx"},
        "w.dlq": {},
        "w.retry.1s": {
            "x-message-ttl": 1000,
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": "w",
        },
        "w.retry.1m": {
            "x-message-ttl": 60000,
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": "w",
        },
    }


def test_quorum_queues_dead_letter_at_least_once_and_limit_deliveries() -> None:
    arguments = queue_arguments(CLASSIC.replace(queue_type="quorum", delivery_limit=7))
    at_least_once = {"x-dead-letter-strategy": "at-least-once", "x-overflow": "reject-publish"}
    assert arguments["w"] == {
        "x-queue-type": "quorum",
        "x-dead-letter-exchange": "w.dlx",
        **at_least_once,
        "x-delivery-limit": 7,
    }
    assert arguments["w.dlq"] == {"x-queue-type": "quorum"}
    assert arguments["w.retry.1s"] == {
        "x-queue-type": "quorum",
        "x-message-ttl": 1000,
        "x-dead-letter-exchange": "",
        "x-dead-letter-routing-key": "w",
        **at_least_once,
    }


def test_a_delivery_limit_of_zero_declares_none() -> None:
    arguments = queue_arguments(CLASSIC.replace(queue_type="quorum", delivery_limit=0))
    assert "x-delivery-limit" not in arguments["w"]


@pytest.mark.parametrize(("raw", "parsed"), [("quorum", "quorum"), (" Classic ", "classic")])
def test_queue_type_is_read_from_the_environment(raw: str, parsed: str) -> None:
    assert Settings.load({"WORKER_QUEUE_TYPE": raw}).queue_type == parsed


@pytest.mark.parametrize("raw", ["stream", "quorum,classic"])
def test_queue_type_refuses_what_the_worker_cannot_declare(raw: str) -> None:
    with pytest.raises(ConfigurationError, match="must be one of classic, quorum"):
        Settings.load({"WORKER_QUEUE_TYPE": raw})
