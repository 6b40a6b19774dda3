"""How a batch of deliveries is checked and split before its transaction, and sorted after its
commit.

Both the consumer (``transport.consumer``) and the test harness (``worker.testing``) take their
batches through these functions (``checked``, ``grouped``, ``after_commit``), so a user's test
sees the grouping, the isolation of culprits and where each delivery goes next exactly as the
running worker does. All are transport-neutral: a delivery is any object ``M`` the caller pairs
with its ``Delivery`` or its opened envelope.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from worker.core.envelope import Delivery, Envelope
from worker.core.handler import HandlerKind
from worker.core.outcomes import Outcome
from worker.core.unit_of_work import Ended, Isolated
from worker.errors import CheckFailed, Fault, KeyReused, Rejected, classify, handler_failed
from worker.sql.rows import InboxKey

M = TypeVar("M")


@dataclass
class Checked(Generic[M]):
    """A batch's deliveries after their checks: ``opened`` passed them (with their envelopes);
    ``rejected`` failed them (with the delivery and why), and take their failure path."""

    opened: list[tuple[M, Envelope]] = field(default_factory=list)
    rejected: list[tuple[M, Delivery, Rejected]] = field(default_factory=list)


def checked(
    deliveries: Sequence[tuple[M, Delivery]], open_one: Callable[[Delivery], Envelope]
) -> Checked[M]:
    """Check each delivery with ``open_one`` (``open_envelope`` with the worker's limits), in
    their order. Nothing a message holds raises past its checks: an error that is no
    ``Rejected`` rejects the delivery as ``CheckFailed``, caused by that error."""
    result: Checked[M] = Checked()
    for message, delivery in deliveries:
        try:
            result.opened.append((message, open_one(delivery)))
        except Rejected as exc:
            result.rejected.append((message, delivery, exc))
        except Exception as exc:
            failed = CheckFailed(f"{type(exc).__name__}: {exc}")
            failed.__cause__ = exc
            result.rejected.append((message, delivery, failed))
    return result


@dataclass
class Grouped(Generic[M]):
    """A batch's checked deliveries before its transaction: ``together`` share one
    (``unit_of_work.process_batch``); ``alone`` each run in a unit of work of their own."""

    together: list[tuple[M, Envelope]] = field(default_factory=list)
    alone: list[tuple[M, Envelope]] = field(default_factory=list)


def grouped(opened: Sequence[tuple[M, Envelope]]) -> Grouped[M]:
    """Split checked deliveries, in their order, into those that share a transaction and
    those that run alone: a workflow always runs alone (its steps are transactions of their
    own), and so does a delivery that would be the only one of its transaction."""
    split: Grouped[M] = Grouped()
    for delivery, envelope in opened:
        runs_alone = envelope.handler.kind is HandlerKind.WORKFLOW
        (split.alone if runs_alone else split.together).append((delivery, envelope))
    if len(split.together) == 1:
        split.alone[:0] = split.together
        split.together = []
    return split


@dataclass
class AfterCommit(Generic[M]):
    """Where the deliveries of a batch whose transaction committed go next: ``committed`` are
    acked with their outcomes; ``failed`` failed for good in it and take their failure path at
    once, together; ``alone`` run on their own. ``isolated`` counts the culprits taken out of
    the batch (``unit_of_work.Isolated``)."""

    committed: list[tuple[M, Envelope, Outcome]] = field(default_factory=list)
    failed: list[tuple[M, Envelope, Exception]] = field(default_factory=list)
    alone: list[tuple[M, Envelope]] = field(default_factory=list)
    isolated: int = 0


def after_commit(together: Sequence[tuple[M, Envelope]], ends: Sequence[Ended]) -> AfterCommit[M]:
    """Sort a committed batch's deliveries by their ``ends`` (in the same order) into
    ``AfterCommit``: each delivery lands in exactly one list.

    A reused key fails for good, and so does a culprit whose error ``classify`` calls permanent:
    run alone it would only fail the same way, a transaction later. A culprit that failed
    otherwise (transiently, or for the deployment) runs alone, with its in-process tries or the
    pause. So does a later copy of a permanent culprit's key: it runs after the first copy's
    failure was recorded, and ends as a duplicate of the failed key rather than as a second
    parked copy. ``failed`` thus holds distinct keys.
    """
    after: AfterCommit[M] = AfterCommit()
    failing: set[InboxKey] = set()
    for (delivery, envelope), end in zip(together, ends, strict=True):
        if isinstance(end, KeyReused):
            after.failed.append((delivery, envelope, end))
        elif isinstance(end, Isolated):
            after.isolated += 1
            key = envelope.inbox_key
            if classify(end.error) is Fault.PERMANENT and key not in failing:
                failing.add(key)
                after.failed.append((delivery, envelope, handler_failed(end.error)))
            else:
                after.alone.append((delivery, envelope))
        else:
            after.committed.append((delivery, envelope, end))
    return after
