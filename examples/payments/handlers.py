"""Payments: settle a requested payment exactly once, and announce it.

``payment.requested`` → add the amount to the account's balance, write a ledger entry and emit
``payment.settled``, all in the worker's one transaction. A redelivery changes nothing.

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
from worker import Context, Router

router = Router(
    "payments", migrations=Path(__file__).parent / "migrations" / "versions", metadata=metadata
)


class PaymentRequested(BaseModel):
    """The body of ``payment.requested``. Types are strict: ``"100"`` is not an amount."""

    model_config = ConfigDict(strict=True)

    payment_id: str = Field(min_length=1)
    account: str = Field(min_length=1)
    amount_cents: int = Field(gt=0)


@router.handler("payment.requested")
async def settle_payment(payment: PaymentRequested, ctx: Context) -> dict[str, Any]:
    """Credit the account, record the ledger entry and emit ``payment.settled``."""
    new = insert(accounts).values(account=payment.account, balance_cents=payment.amount_cents)
    credit = new.on_conflict_do_update(
        index_elements=[accounts.c.account],
        set_={"balance_cents": accounts.c.balance_cents + new.excluded.balance_cents},
    ).returning(accounts.c.balance_cents)
    balance_cents = (await ctx.session.execute(credit)).scalar_one()
    await ctx.session.execute(
        insert(ledger_entries).values(
            payment_id=payment.payment_id,
            account=payment.account,
            amount_cents=payment.amount_cents,
        )
    )
    settled = {
        "payment_id": payment.payment_id,
        "account": payment.account,
        "amount_cents": payment.amount_cents,
        "balance_cents": balance_cents,
    }
    ctx.publish("payment.settled", settled, ordering_key=payment.account)
    return settled


class PaymentSettled(PaymentRequested):
    """The body of ``payment.settled``: the payment and the account's balance after it."""

    balance_cents: int


@router.handler("payment.settled")
async def record_settlement_notice(event: PaymentSettled, ctx: Context) -> None:
    """Log the notice the account holder gets for a settled payment (one row per event)."""
    await ctx.session.execute(
        insert(settlement_notices).values(
            payment_id=event.payment_id,
            event_id=ctx.message_id or ctx.key,
            account=event.account,
            amount_cents=event.amount_cents,
            balance_cents=event.balance_cents,
        )
    )
