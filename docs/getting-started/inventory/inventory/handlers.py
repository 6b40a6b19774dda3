"""Inventory handlers: each message changes a stock level exactly once, and says so.

``stock.received`` adds to a SKU's level; ``stock.reserved`` takes from it, never below zero.
Each handler runs in the worker's transaction: its write, the idempotency key and the
``stock.changed`` event it publishes commit together, or not at all.
"""

from pathlib import Path

from pydantic import BaseModel, Field
from sqlalchemy import update
from sqlalchemy.dialects.postgresql import insert
from worker import Context, Permanent, Router

from inventory.tables import metadata, stock_levels

# "inventory" names the migration history (version table `alembic_version_inventory`).
router = Router(
    "inventory", migrations=Path(__file__).parent / "migrations" / "versions", metadata=metadata
)


class StockMoved(BaseModel):
    """The body of ``stock.received`` and ``stock.reserved``."""

    sku: str = Field(min_length=1)
    quantity: int = Field(gt=0)


class StockChanged(BaseModel):
    """The body of ``stock.changed``: the SKU's level after the change."""

    sku: str
    on_hand: int


class OutOfStock(Permanent):
    """Fewer items on hand than reserved: no retry helps, so the message is dead-lettered."""


@router.handler("stock.received", publishes={"stock.changed": StockChanged})
async def receive_stock(msg: StockMoved, ctx: Context) -> StockChanged:
    """Add the quantity to the SKU's level (its row is created on first receipt)."""
    new = insert(stock_levels).values(sku=msg.sku, on_hand=msg.quantity)
    upsert = new.on_conflict_do_update(
        index_elements=[stock_levels.c.sku],
        set_={"on_hand": stock_levels.c.on_hand + new.excluded.on_hand},
    )
    on_hand = await ctx.session.scalar(upsert.returning(stock_levels.c.on_hand))
    assert on_hand is not None  # (the upsert returns its row)
    changed = StockChanged(sku=msg.sku, on_hand=on_hand)
    ctx.publish("stock.changed", changed)  # an outbox row, in the same transaction
    return changed  # stored with the idempotency key


@router.handler("stock.reserved", publishes={"stock.changed": StockChanged})
async def reserve_stock(msg: StockMoved, ctx: Context) -> StockChanged:
    """Take the quantity off the SKU's level, or refuse: the level never goes below zero."""
    on_hand = await ctx.session.scalar(
        update(stock_levels)
        .where(stock_levels.c.sku == msg.sku, stock_levels.c.on_hand >= msg.quantity)
        .values(on_hand=stock_levels.c.on_hand - msg.quantity)
        .returning(stock_levels.c.on_hand)
    )
    if on_hand is None:
        raise OutOfStock(f"cannot reserve {msg.quantity} of {msg.sku!r}: not enough on hand")
    changed = StockChanged(sku=msg.sku, on_hand=on_hand)
    ctx.publish("stock.changed", changed)
    return changed
