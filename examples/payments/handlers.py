"""Payments: settle a requested payment exactly once, and announce it.

``payment.requested`` → add the amount to the account's balance, write a ledger entry and emit
``payment.settled``, all in the worker's one transaction. A redelivery changes nothing. Its
handler is a batch handler (set-based writes for a whole batch of payments).

``payment.settled`` → record a settlement notice for the account holder, once per event: the
relay may publish an event more than once, and the inbox recognises the repeat by its message id.
Events of one account carry the account as their ordering key, so notices follow the balance.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.dialects.postgresql import insert

from examples.payments.tables import accounts, ledger_entries, metadata, settlement_notices
from worker import Batch, Context, MessageFailed, Permanent, Router

router = Router(
    "payments", migrations=Path(__file__).parent / "migrations" / "versions", metadata=metadata
)


INT64_MAX = 2**63 - 1
"""The largest amount a PostgreSQL bigint column holds."""

NO_NUL = r"^[^\x00]*$"
"""PostgreSQL text cannot hold a NUL character: refuse it at validation, not at the INSERT."""


class PaymentRequested(BaseModel):
    """The body of ``payment.requested``. Types are strict: ``"100"`` is not an amount; amounts
    fit a bigint and texts hold no NUL, so every valid body can be stored."""

    model_config = ConfigDict(strict=True)

    payment_id: str = Field(min_length=1, pattern=NO_NUL)
    account: str = Field(min_length=1, pattern=NO_NUL)
    amount_cents: int = Field(gt=0, le=INT64_MAX)


CREDIT_ACCOUNTS = """
INSERT INTO accounts (account, balance_cents)
SELECT c.account, c.cents FROM unnest($1::text[], $2::bigint[]) AS c(account, cents)
ON CONFLICT (account) DO UPDATE SET balance_cents = accounts.balance_cents + excluded.balance_cents
RETURNING account, balance_cents
"""

RECORD_LEDGER_ENTRIES = """
INSERT INTO ledger_entries (payment_id, account, amount_cents)
SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[])
ON CONFLICT (payment_id) DO NOTHING
RETURNING payment_id
"""


class DuplicatePayment(Permanent):
    """This payment id was settled before under another idempotency key: paying it again would
    charge twice, so the message is dead-lettered for a person to look at."""


class PaymentSettled(PaymentRequested):
    """The body of ``payment.settled``: the payment and the account's balance after it."""

    balance_cents: int = Field(ge=-INT64_MAX - 1, le=INT64_MAX)


@router.batch_handler("payment.requested", publishes={"payment.settled": PaymentSettled})
async def settle_payments(payments: list[PaymentRequested], batch: Batch) -> list[dict[str, Any]]:
    """Record the ledger entries, credit the accounts and emit one ``payment.settled`` each.

    A batch handler: it gets every payment of a batch (distinct idempotency keys) and writes them
    set-based, one insert for the ledger and one upsert for the accounts (in account order, so
    concurrent batches lock them in the same order), each one statement whatever the batch's
    size, sent on ``batch.asyncpg`` (the transaction's own asyncpg connection: the fastest way;
    the same writes through SQLAlchemy Core are ``settle_payments_with_sqlalchemy``). A payment
    id already in the ledger under another key fails its message alone (``MessageFailed``): the
    rest of the batch goes on without it. A message handled alone is a batch of one.
    """
    recorded = await batch.asyncpg.fetch(
        RECORD_LEDGER_ENTRIES,
        [p.payment_id for p in payments],
        [p.account for p in payments],
        [p.amount_cents for p in payments],
    )
    _refuse_duplicates(payments, {row[0] for row in recorded})
    totals = _totals(payments)
    accounts_in_order = sorted(totals)
    credited = await batch.asyncpg.fetch(
        CREDIT_ACCOUNTS, accounts_in_order, [totals[a] for a in accounts_in_order]
    )
    return _settle(payments, batch, totals, {row[0]: row[1] for row in credited})


async def settle_payments_with_sqlalchemy(
    payments: list[PaymentRequested], batch: Batch
) -> list[dict[str, Any]]:
    """``settle_payments`` with its two writes through SQLAlchemy Core on ``batch.connection``
    (the same transaction); ``benchmarks/throughput.py`` measures the two against each other."""
    record = (
        insert(ledger_entries)
        .on_conflict_do_nothing(index_elements=[ledger_entries.c.payment_id])
        .returning(ledger_entries.c.payment_id)
    )
    recorded = await batch.connection.execute(
        record,
        [
            {"payment_id": p.payment_id, "account": p.account, "amount_cents": p.amount_cents}
            for p in payments
        ],
    )
    _refuse_duplicates(payments, {row.payment_id for row in recorded})
    totals = _totals(payments)
    new = insert(accounts)
    credit = new.on_conflict_do_update(
        index_elements=[accounts.c.account],
        set_={"balance_cents": accounts.c.balance_cents + new.excluded.balance_cents},
    ).returning(accounts.c.account, accounts.c.balance_cents)
    credits = [{"account": a, "balance_cents": total} for a, total in sorted(totals.items())]
    balances = {
        row.account: row.balance_cents for row in await batch.connection.execute(credit, credits)
    }
    return _settle(payments, batch, totals, balances)


def _refuse_duplicates(payments: list[PaymentRequested], recorded: set[str]) -> None:
    """Raise ``MessageFailed`` naming each payment the ledger did not take: its id was in the
    ledger already, or earlier in this batch (the insert takes the rows in the batch's order)."""
    taken: set[str] = set()
    duplicates = []
    for index, payment in enumerate(payments):
        if payment.payment_id in recorded and payment.payment_id not in taken:
            taken.add(payment.payment_id)
        else:
            duplicates.append(index)
    if duplicates:
        ids = ", ".join(sorted({payments[i].payment_id for i in duplicates}))
        raise MessageFailed(*duplicates) from DuplicatePayment(
            f"payment {ids} was settled before under another idempotency key"
        )


def _totals(payments: list[PaymentRequested]) -> dict[str, int]:
    totals: dict[str, int] = {}
    for payment in payments:
        totals[payment.account] = totals.get(payment.account, 0) + payment.amount_cents
    return totals


def _settle(
    payments: list[PaymentRequested],
    batch: Batch,
    totals: dict[str, int],
    balances: dict[str, int],
) -> list[dict[str, Any]]:
    """Emit one ``payment.settled`` per payment, carrying its account's balance right after it
    (in the batch's order), and return the events as the payments' results."""
    running = {account: balances[account] - total for account, total in totals.items()}
    settled = []
    for payment, ctx in zip(payments, batch, strict=True):
        running[payment.account] += payment.amount_cents
        event = {
            "payment_id": payment.payment_id,
            "account": payment.account,
            "amount_cents": payment.amount_cents,
            "balance_cents": running[payment.account],
        }
        ctx.publish("payment.settled", event, ordering_key=payment.account)
        settled.append(event)
    return settled


@router.handler("payment.settled")  # a plain handler: one body, one Context
async def record_settlement_notice(event: PaymentSettled, ctx: Context) -> None:
    """Log the notice the account holder gets for a settled payment (one row per event)."""
    await ctx.connection.execute(
        insert(settlement_notices).values(
            payment_id=event.payment_id,
            event_id=ctx.message_id or ctx.key,
            account=event.account,
            amount_cents=event.amount_cents,
            balance_cents=event.balance_cents,
        )
    )
