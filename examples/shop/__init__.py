"""The shop example: a FastAPI app (``examples/shop/app.py``) that records an order in its own
table and announces it with ``worker.outbox.publish`` in the same transaction.

It has no handlers; as a handler module it only brings its table's migration:
``worker migrate --handlers examples.shop``. Its ``order.placed`` events are what the orders
example (``examples.orders``) fulfils.
"""

from pathlib import Path

from examples.shop.tables import metadata
from worker import Router

router = Router(
    "shop", migrations=Path(__file__).parent / "migrations" / "versions", metadata=metadata
)

__all__ = ["router"]
