"""A fake payment gateway: a stand-in for an HTTP payment API, to swap for a real client.

It behaves like a gateway that takes idempotency keys: every call with the same key returns the
same charge id (``ch_`` + the first 16 hex digits of the key's SHA-256), or for a refund the same
refund id (``re_`` + the same digits), so a repeated call charges or refunds nothing more. Every
call, repeats included, is recorded in ``gateway_calls`` in a transaction of its own, on a
connection of its own: what an external service recorded does not roll back with the caller's
transaction. Hence the caller must give a key that stays the same across retries and
redeliveries (a workflow step's ``ctx.step_key``).
"""

from __future__ import annotations

import hashlib

from sqlalchemy import insert
from sqlalchemy.ext.asyncio import AsyncEngine

from examples.orders.tables import gateway_calls


def _digest(idempotency_key: str) -> str:
    return hashlib.sha256(idempotency_key.encode()).hexdigest()[:16]


def charge_id_for(idempotency_key: str) -> str:
    """The charge id the fake gateway returns for every charge with ``idempotency_key``."""
    return "ch_" + _digest(idempotency_key)


def refund_id_for(idempotency_key: str) -> str:
    """The refund id the fake gateway returns for every refund with ``idempotency_key``."""
    return "re_" + _digest(idempotency_key)


class FakeGateway:
    """A payment gateway whose only record is ``gateway_calls`` in the database of ``engine``.

    A real client would hold a base URL and credentials instead, and ``charge`` and ``refund``
    would be HTTP requests sending ``idempotency_key`` as the ``Idempotency-Key`` header.
    """

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    async def charge(self, *, idempotency_key: str, amount_cents: int) -> str:
        """Charge ``amount_cents`` at most once per ``idempotency_key``; return the charge id."""
        charge_id = charge_id_for(idempotency_key)
        await self._record("charge", idempotency_key, amount_cents, charge_id, refund_id=None)
        return charge_id

    async def refund(self, *, idempotency_key: str, charge_id: str, amount_cents: int) -> str:
        """Refund ``amount_cents`` of ``charge_id`` at most once per ``idempotency_key``; return
        the refund id."""
        refund_id = refund_id_for(idempotency_key)
        await self._record("refund", idempotency_key, amount_cents, charge_id, refund_id=refund_id)
        return refund_id

    async def _record(
        self,
        operation: str,
        idempotency_key: str,
        amount_cents: int,
        charge_id: str,
        *,
        refund_id: str | None,
    ) -> None:
        async with self._engine.begin() as conn:
            await conn.execute(
                insert(gateway_calls).values(
                    idempotency_key=idempotency_key,
                    operation=operation,
                    amount_cents=amount_cents,
                    charge_id=charge_id,
                    refund_id=refund_id,
                )
            )
