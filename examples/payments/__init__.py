"""The payments example handler module: ``worker run --handlers examples.payments``."""

from examples.payments.handlers import PaymentRequested, router, settle_payments

__all__ = ["PaymentRequested", "router", "settle_payments"]
