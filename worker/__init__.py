"""worker: an asyncio RabbitMQ worker with exactly-once effects in PostgreSQL and an outbox."""

from worker.core.context import Batch, Context, OutboxMessage
from worker.core.envelope import Delivery
from worker.core.router import Handler, Router
from worker.core.workflows import Workflow, WorkflowBusy
from worker.errors import Permanent, Rejected, Retryable, WorkerError
from worker.settings import Settings

__all__ = [
    "Batch",
    "Context",
    "Delivery",
    "Handler",
    "OutboxMessage",
    "Permanent",
    "Rejected",
    "Retryable",
    "Router",
    "Settings",
    "WorkerError",
    "Workflow",
    "WorkflowBusy",
]
