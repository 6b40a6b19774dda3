"""Recipe: consume another service's events, tolerant of the fields it adds later and keyed by
what it sends (docs/recipes/consume-events.md)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from worker import Context, Router

router = Router()


class OrderPaid(BaseModel):
    """The fields of the billing service's ``billing.order_paid`` that this service reads.
    Fields billing adds later are ignored, not refused: its events stay valid here."""

    model_config = ConfigDict(extra="ignore")

    order_id: str
    customer_id: str
    amount_cents: int


@router.handler("billing.order_paid")
async def award_points(event: OrderPaid, ctx: Context) -> dict[str, int]:
    points = event.amount_cents // 100
    # The effect: an event of this service's own, in the same transaction as the key's claim.
    ctx.publish(
        "loyalty.points_awarded",
        {"customer_id": event.customer_id, "order_id": event.order_id, "points": points},
    )
    return {"points": points}
