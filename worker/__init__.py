"""worker: an asyncio RabbitMQ worker with exactly-once effects in PostgreSQL and an outbox."""

from worker.context import Batch, Context, OutboxMessage
from worker.envelope import Delivery
from worker.errors import Permanent, Rejected, Retryable, WorkerError
from worker.router import Handler, Router
from worker.settings import Settings
from worker.workflows import Workflow, WorkflowBusy

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
