"""Recipe: call an external API exactly once per message, from a workflow step whose
``ctx.step_key`` the API takes as its idempotency key (docs/recipes/external-api.md)."""

from __future__ import annotations

from pydantic import BaseModel

from worker import Context, Router, Workflow

router = Router()


class ChargeRequested(BaseModel):
    invoice_id: str
    amount_cents: int


class PaymentProvider:
    """Stands in for a payment API with idempotency keys (Stripe's, Adyen's, most banks'): a
    request under a key it has seen answers with the first one's charge, charging nothing."""

    def __init__(self) -> None:
        self.charges: dict[str, tuple[str, int]] = {}  # idempotency key -> (charge id, cents)
        self.requests = 0

    async def charge(self, *, idempotency_key: str, amount_cents: int) -> str:
        self.requests += 1
        if idempotency_key not in self.charges:
            self.charges[idempotency_key] = (f"ch_{len(self.charges) + 1}", amount_cents)
        return self.charges[idempotency_key][0]


provider = PaymentProvider()


@router.workflow("invoice.charge_requested")
async def charge_invoice(invoice: ChargeRequested, wf: Workflow) -> dict[str, str]:
    charge_id = await wf.step("charge", charge, invoice)
    return {"invoice_id": invoice.invoice_id, "charge_id": charge_id}


async def charge(ctx: Context, invoice: ChargeRequested) -> str:
    # ctx.step_key is "<message key>:charge", the same on every run of this step: a retry after
    # a lost answer or a crash before the step's commit asks again under the same key.
    return await provider.charge(idempotency_key=ctx.step_key, amount_cents=invoice.amount_cents)
