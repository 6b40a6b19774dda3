"""What must hold in the payments example's tables once it is quiet; ``worker verify --handlers
examples.payments`` checks it (``worker.ops.verify`` finds the ``invariants`` list below).

Exactly once: each account's balance is the sum of its ledger entries (a payment's effect
applied twice, or half, would break it; ``ledger_entries``' primary key already forbids a second
entry per payment). One notice per settlement: each ledger entry has exactly one
``settlement_notices`` row, for the same account and amount, and no notice lacks its entry.
Optionally, the balances are those a driver expected, and every settled payment's
``payment.settled`` event reached a downstream queue at least once (repeats are allowed).
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from aio_pika.exceptions import ChannelNotFoundEntity
from sqlalchemy import Select, func, or_, select
from sqlalchemy.ext.asyncio import AsyncConnection

from examples.payments.tables import accounts, ledger_entries, settlement_notices
from worker.ops.verify import Check, Deployment, Invariant, sample

SETTLED = "payment.settled"


async def balances_match_ledger(deployment: Deployment) -> Check:
    """Every account's balance equals the sum of its ledger entries (and no entry lacks its
    account)."""
    ledger = (
        select(
            ledger_entries.c.account,
            func.sum(ledger_entries.c.amount_cents).label("ledger_cents"),
        )
        .group_by(ledger_entries.c.account)
        .subquery()
    )
    account = func.coalesce(accounts.c.account, ledger.c.account)
    balance = func.coalesce(accounts.c.balance_cents, 0)
    ledger_cents = func.coalesce(ledger.c.ledger_cents, 0)
    differ = (
        select(account.label("account"), balance.label("balance"), ledger_cents.label("ledger"))
        .select_from(accounts.join(ledger, accounts.c.account == ledger.c.account, full=True))
        .where(balance != ledger_cents)
        .order_by(account)
    )
    async with deployment.engine.connect() as conn:
        wrong = (await conn.execute(differ)).all()
        totals = (
            await conn.execute(
                select(
                    select(func.count()).select_from(accounts).scalar_subquery(),
                    select(func.count()).select_from(ledger_entries).scalar_subquery(),
                )
            )
        ).one()
    if not wrong:
        return Check(
            "balances-match-ledger",
            True,
            f"{totals[0]} account(s), {totals[1]} ledger entries: each balance is its ledger sum",
        )
    names = [f"{row.account} balance {row.balance} != ledger {row.ledger}" for row in wrong]
    return Check(
        "balances-match-ledger",
        False,
        f"{len(wrong)} of {totals[0]} account(s) differ from their ledger sums "
        f"({totals[1]} entries): {sample(names, len(wrong))}",
    )


async def one_notice_per_settlement(deployment: Deployment) -> Check:
    """Each ledger entry has one settlement notice, for its account and amount, and each notice
    its ledger entry (``settlement_notices`` is keyed by payment, so never two)."""
    entry, notice = ledger_entries.c, settlement_notices.c
    same_payment = entry.payment_id == notice.payment_id
    async with deployment.engine.connect() as conn:
        entries = await _count(conn, select(func.count()).select_from(ledger_entries))
        notices = await _count(conn, select(func.count()).select_from(settlement_notices))
        missing = await _ids(
            conn,
            select(entry.payment_id)
            .select_from(ledger_entries.outerjoin(settlement_notices, same_payment))
            .where(notice.payment_id.is_(None)),
        )
        orphans = await _ids(
            conn,
            select(notice.payment_id)
            .select_from(settlement_notices.outerjoin(ledger_entries, same_payment))
            .where(entry.payment_id.is_(None)),
        )
        mismatched = await _ids(
            conn,
            select(entry.payment_id)
            .select_from(ledger_entries.join(settlement_notices, same_payment))
            .where(or_(entry.account != notice.account, entry.amount_cents != notice.amount_cents)),
        )
    problems = [
        f"{len(ids)} {what}: {sample(ids, len(ids))}"
        for what, ids in (
            ("settlement(s) without a notice", missing),
            ("notice(s) without a ledger entry", orphans),
            ("notice(s) with another account or amount than their entry", mismatched),
        )
        if ids
    ]
    counted = f"{entries} ledger entries, {notices} notice(s)"
    if problems:
        return Check("one-notice-per-settlement", False, f"{counted}; " + "; ".join(problems))
    return Check("one-notice-per-settlement", True, f"{counted}: one notice per settlement")


async def expected_balances(deployment: Deployment) -> Check | None:
    """With ``expected_balances``: every account's balance is the expected one (an account
    absent from either side counts as 0)."""
    expected = deployment.options.expected_balances
    if expected is None:
        return None
    async with deployment.engine.connect() as conn:
        rows = await conn.execute(select(accounts.c.account, accounts.c.balance_cents))
        actual = {account: int(cents) for account, cents in rows}
    wrong = [
        f"{account} {actual.get(account, 0)} != expected {expected.get(account, 0)}"
        for account in sorted(set(actual) | set(expected))
        if actual.get(account, 0) != expected.get(account, 0)
    ]
    if wrong:
        return Check(
            "expected-balances",
            False,
            f"{len(wrong)} account(s) differ from the expected balances: "
            f"{sample(wrong, len(wrong))}",
        )
    return Check("expected-balances", True, f"{len(expected)} account(s) as expected")


async def settled_events_delivered(deployment: Deployment) -> Check | None:
    """With ``capture_queue`` (a queue bound to ``payment.settled``): every ledger entry's event
    arrived there at least once, and every event there is of a ledger entry.

    Destructive: the queue is drained, each message acked, until the broker has none left; the
    next run sees only what arrived since. Ledger entries are read before draining (their events
    must be there) and again after (an event may belong to an entry committed meanwhile).
    """
    queue_name = deployment.options.capture_queue
    if queue_name is None:
        return None
    async with deployment.engine.connect() as conn:
        settled = set(await _ids(conn, select(ledger_entries.c.payment_id)))
    channel = await deployment.connection.channel()
    try:
        try:
            queue = await channel.declare_queue(queue_name, passive=True)
        except ChannelNotFoundEntity:
            return Check("settled-events-delivered", False, f"queue {queue_name} does not exist")
        captured: Counter[str] = Counter()
        drained = malformed = 0
        while (message := await queue.get(no_ack=False, fail=False)) is not None:
            drained += 1
            if message.routing_key == SETTLED:
                payment_id = _payment_id(message.body)
                if payment_id is None:
                    malformed += 1
                else:
                    captured[payment_id] += 1
            await message.ack()
    finally:
        if not channel.is_closed:
            await channel.close()
    async with deployment.engine.connect() as conn:
        known = set(
            await _ids(
                conn,
                select(ledger_entries.c.payment_id).where(
                    ledger_entries.c.payment_id.in_(list(captured))
                ),
            )
        )
    missing = sorted(settled - set(captured))
    unknown = sorted(set(captured) - known)
    duplicates = sum(captured.values()) - len(captured)
    summary = (
        f"drained {drained} message(s) from {queue_name}: {sum(captured.values())} {SETTLED} "
        f"for {len(captured)} payment(s), {duplicates} repeat(s) (allowed)"
    )
    problems = [
        f"{len(ids)} {what}: {sample(ids, len(ids))}"
        for what, ids in (
            (f"of {len(settled)} settled payment(s) never delivered", missing),
            ("event(s) of payments without a ledger entry", unknown),
            (f"{SETTLED} without a payment_id", [str(malformed)] if malformed else []),
        )
        if ids
    ]
    if problems:
        return Check("settled-events-delivered", False, f"{summary}; " + "; ".join(problems))
    return Check(
        "settled-events-delivered",
        True,
        f"{summary}; each of {len(settled)} settled payment(s) delivered",
    )


def _payment_id(body: bytes) -> str | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    payment_id = value.get("payment_id") if isinstance(value, dict) else None
    return payment_id if isinstance(payment_id, str) else None


async def _count(conn: AsyncConnection, stmt: Select[Any]) -> int:
    return int((await conn.execute(stmt)).scalar_one())


async def _ids(conn: AsyncConnection, stmt: Select[Any]) -> list[str]:
    return [str(value) for value in (await conn.execute(stmt)).scalars()]


invariants: list[Invariant] = [
    balances_match_ledger,
    one_notice_per_settlement,
    expected_balances,
    settled_events_delivered,
]
"""Checked by ``worker verify`` in this order, after the worker's own invariants."""
