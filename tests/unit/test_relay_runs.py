"""Which rows a relay batch publishes, and in which runs: a table of batches."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest

from worker.sql.outbox import OutboxRow
from worker.transport.relay import runs_to_publish


def batch(keys: str) -> list[OutboxRow]:
    """A batch of rows in id order, one per character: its ordering key, ``.`` for none."""
    return [
        OutboxRow(
            id=n,
            message_id=uuid.uuid4(),
            exchange="events",
            routing_key="event.created",
            body=b"{}",
            content_type="application/json",
            headers={},
            correlation_id=None,
            causation_id=None,
            ordering_key=None if key == "." else key,
            attempts=0,
            created_at=datetime.now(UTC),
        )
        for n, key in enumerate(keys)
    ]


@pytest.mark.parametrize(
    ("keys", "runs"),
    [
        # no keys: every row a run of its own, all at once
        ("...", [[0], [1], [2]]),
        # one hot key: its whole run, one row at a time
        ("aaaa", [[0, 1, 2, 3]]),
        # few keys, long runs: each key's run in full
        ("abababa.", [[7], [0, 2, 4, 6], [1, 3, 5]]),
        # many keys, a few repeated: each key's first row only (the rest wait for a later batch)
        ("abcda.e", [[5], [0], [1], [2], [3], [6]]),
        # as many keys as repeats: still first rows only
        ("abab", [[0], [1]]),
        # exactly half as many keys as keyed rows: first rows only
        ("aaab", [[0], [3]]),
        # fewer: runs in full
        ("aaaab", [[0, 1, 2, 3], [4]]),
    ],
)
def test_runs_to_publish(keys: str, runs: list[list[int]]) -> None:
    assert [[row.id for row in run] for run in runs_to_publish(batch(keys))] == runs
