"""worker: an asyncio RabbitMQ worker with exactly-once effects in PostgreSQL and an outbox."""

from worker.context import Context, OutboxMessage
from worker.envelope import Delivery
from worker.errors import Rejected, Retryable, WorkerError
from worker.router import Handler, Router
from worker.settings import Settings

__all__ = [
    "Context",
    "Delivery",
    "Handler",
    "OutboxMessage",
    "Rejected",
    "Retryable",
    "Router",
    "Settings",
    "WorkerError",
]
