"""``worker.ops.dlq``'s pure parts: a selection by filters or by ids (``NO_HANDLER`` for the
copies without a handler), the groups of a scan by reason and handler, and the tally of a bulk
action that the CLI's summary and the console's preview share."""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator
from datetime import UTC, datetime, timedelta

import pytest

from worker.ops import dlq

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def parked(
    key: str | None = "k",
    *,
    handler: str | None = "pay",
    reason: str = "handler-error",
    error: str = "KeyError: 'account'",
    at: datetime | None = T0,
    verified: bool = True,
    body: bytes = b"{}",
) -> dlq.Parked:
    """A parked copy: the worker's own (with a parking id), or an unverified one."""
    if verified:
        return dlq.Parked(
            key=key,
            handler=handler,
            reason=reason,
            error=error,
            exception_type="KeyError",
            attempts=1,
            first_failure_at="",
            routing_key=handler or "",
            message_id=None,
            dead_lettered_at=at,
            parking_id=uuid.uuid4(),
        )
    return dlq.Parked(
        key=key,
        handler=None,
        reason=dlq.UNVERIFIED,
        error="",
        exception_type="",
        attempts=0,
        first_failure_at="",
        routing_key="pay",
        message_id=None,
        dead_lettered_at=at,
        unverified_because="no record",
        claims={"handler": "pay"},
        body_sha256=body.ljust(32, b"\0"),
    )


MINE = parked()
HANDLERLESS = parked(handler=None, reason="no-handler")
FORGED = parked(verified=False)


@pytest.mark.parametrize(
    ("selection", "selected"),
    [
        (dlq.Selection(), [MINE, HANDLERLESS, FORGED]),
        (dlq.Selection(handler="pay"), [MINE]),  # a forged copy's handler header is a claim
        (dlq.Selection(handler=dlq.NO_HANDLER), [HANDLERLESS, FORGED]),
        (dlq.Selection(reason="no-handler", handler=dlq.NO_HANDLER), [HANDLERLESS]),
        (dlq.Selection(reason=dlq.UNVERIFIED, handler=dlq.NO_HANDLER), [FORGED]),
        (dlq.Selection(ids=frozenset({MINE.id, FORGED.id})), [MINE, FORGED]),
        (dlq.Selection(ids=frozenset({MINE.id}), reason="no-handler"), []),
        (dlq.Selection(ids=frozenset()), []),
    ],
)
def test_a_selection_takes_the_copies_every_filter_given_matches(
    selection: dlq.Selection, selected: list[dlq.Parked]
) -> None:
    assert [p for p in (MINE, HANDLERLESS, FORGED) if selection.matches(p)] == selected
    assert selection.filters is (selection != dlq.EVERYTHING)


def test_a_forged_copy_is_selected_by_its_body_digest_not_by_a_parking_id() -> None:
    assert FORGED.id.startswith("sha256:")
    assert dlq.Selection(ids=frozenset({str(MINE.parking_id)})).matches(MINE)
    assert not dlq.Selection(ids=frozenset({FORGED.id})).matches(MINE)


@pytest.mark.parametrize(
    ("selection", "said"),
    [
        (dlq.Selection(), "everything"),
        (dlq.Selection(key="k1", reason="invalid", handler="-"), "reason=invalid handler=- key=k1"),
        (dlq.Selection(ids=frozenset({"b", "a"})), "ids=a,b"),
    ],
)
def test_a_selection_is_described_as_chosen(selection: dlq.Selection, said: str) -> None:
    assert selection.describe() == said


def test_groups_count_by_reason_and_handler_with_first_last_and_an_example() -> None:
    # Given copies of two handlers, one handler-less and two forged, parked at different times
    grouping = dlq.Grouping()
    for copy in (
        parked(at=T0 + timedelta(minutes=5), error="first error"),
        parked(handler="ship", at=T0),
        parked(at=T0 - timedelta(minutes=1), error="second error"),
        parked(at=None),
        HANDLERLESS,
        FORGED,
        parked("k2", verified=False, at=T0 + timedelta(hours=1)),
        parked(at=T0 + timedelta(minutes=2)),
    ):
        grouping.add(copy)

    # When they are summed up
    groups = grouping.groups()

    # Then each (reason, handler) is one group, the largest first, with its time span (a copy
    # parked at an unknown time widens nothing) and its first error; forged copies are one
    # group, without a handler, whose example says why they are unverified
    assert [(g.reason, g.handler, g.count) for g in groups] == [
        ("handler-error", "pay", 4),
        ("unverified", "-", 2),
        ("handler-error", "ship", 1),
        ("no-handler", "-", 1),
    ]
    pay, forged, _, _ = groups
    assert (pay.first, pay.last) == (T0 - timedelta(minutes=1), T0 + timedelta(minutes=5))
    assert pay.example == "first error"
    assert (forged.first, forged.last) == (T0, T0 + timedelta(hours=1))
    assert forged.example == "unverified: no record"
    # and each group's selection takes its messages and no other
    assert forged.selection == dlq.Selection(reason="unverified", handler="-")
    assert not pay.selection.matches(FORGED)


def test_no_copy_no_group() -> None:
    assert dlq.Grouping().groups() == []
    assert dlq.Groups([], 0, more=False).count == 0


async def test_a_tally_counts_what_was_done_by_group_and_what_was_refused_by_why() -> None:
    outcomes = [
        dlq.Outcome(MINE),
        dlq.Outcome(HANDLERLESS),
        dlq.Outcome(FORGED, refused="unverified"),
        dlq.Outcome(MINE),
        dlq.Outcome(parked(), refused="too old"),
        dlq.Outcome(FORGED, refused="unverified"),
    ]

    async def run() -> AsyncGenerator[dlq.Outcome, None]:
        for outcome in outcomes:
            yield outcome

    seen: list[dlq.Outcome] = []
    tally = await dlq.Tally().carry_out(run(), seen.append)

    assert seen == outcomes
    assert tally.done == {("handler-error", "pay"): 2, ("no-handler", "-"): 1}
    assert tally.refused == {"unverified": 2, "too old": 1}
    assert (tally.done_count, tally.refused_count) == (3, 3)


async def test_a_tally_keeps_what_was_done_before_a_failure() -> None:
    async def run() -> AsyncGenerator[dlq.Outcome, None]:
        yield dlq.Outcome(MINE)
        raise ConnectionError("the broker went away")

    tally = dlq.Tally()
    with pytest.raises(ConnectionError):
        await tally.carry_out(run())

    assert tally.done_count == 1
