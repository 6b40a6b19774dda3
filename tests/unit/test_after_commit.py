"""Where the deliveries of a committed batch go next (``core.batches.after_commit``), as a table:
each lands in exactly one place, and a key takes the failure path at most once."""

from __future__ import annotations

from typing import Any

from tests.helpers import envelope
from worker import Context, Router
from worker.core.batches import after_commit
from worker.core.envelope import Envelope
from worker.core.outcomes import Outcome
from worker.core.unit_of_work import Ended, Isolated
from worker.errors import HandlerFailed, KeyReused, Permanent, Retryable

router = Router()


@router.handler("note")
async def note(body: Any, ctx: Context) -> None:
    """A stand-in: after_commit never runs handlers."""


def delivered(key: str, body: int = 1) -> Envelope:
    return envelope(router, "note", body, key)


def test_each_delivery_lands_in_exactly_one_place() -> None:
    # Given a committed batch: two committed, a reused key, a culprit that failed for good, a
    # culprit that failed transiently, and a later copy of the first culprit's key
    bad, reused = ValueError("bad"), KeyReused()
    batch: list[tuple[str, Envelope, Ended]] = [
        ("m1", delivered("k1"), Outcome.PROCESSED),
        ("m2", delivered("k2"), reused),
        ("m3", delivered("k3"), Isolated(bad)),
        ("m4", delivered("k4"), Isolated(Retryable("busy"))),
        ("m5", delivered("k1"), Outcome.DUPLICATE),
        ("m6", delivered("k3"), Isolated(bad)),
        ("m7", delivered("k7"), Isolated(Permanent("declined"))),
    ]

    after = after_commit([(m, e) for m, e, _ in batch], [end for _, _, end in batch])

    # Then the committed are acked with their outcomes, the reused key and the first copy of each
    # culprit that failed for good take the failure path (a handler's error as HandlerFailed),
    # and the transient culprit and the later copy of k3 run alone
    assert [(m, e.key, o) for m, e, o in after.committed] == [
        ("m1", "k1", Outcome.PROCESSED),
        ("m5", "k1", Outcome.DUPLICATE),
    ]
    assert [(m, e.key) for m, e, _ in after.failed] == [("m2", "k2"), ("m3", "k3"), ("m7", "k7")]
    errors = [exc for _, _, exc in after.failed]
    assert errors[0] is reused
    assert isinstance(errors[1], HandlerFailed)
    assert errors[1].__cause__ is bad
    assert isinstance(errors[2], HandlerFailed)
    assert [(m, e.key) for m, e in after.alone] == [("m4", "k4"), ("m6", "k3")]
    assert after.isolated == 4
    placed = [m for m, *_ in after.committed] + [m for m, *_ in after.failed]
    assert sorted(placed + [m for m, _ in after.alone]) == [m for m, _, _ in batch]


def test_a_batch_without_failures_is_all_committed() -> None:
    batch = [("m1", delivered("k1")), ("m2", delivered("k2"))]
    after = after_commit(batch, [Outcome.PROCESSED, Outcome.DUPLICATE_OF_FAILED])
    assert [m for m, _, _ in after.committed] == ["m1", "m2"]
    assert (after.failed, after.alone, after.isolated) == ([], [], 0)
