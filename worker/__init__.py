"""worker: an asyncio RabbitMQ worker with exactly-once effects in PostgreSQL and an outbox."""

from worker import outbox
from worker.core.context import Batch, Context
from worker.core.envelope import Delivery
from worker.core.handler import Handler, HandlerKind
from worker.core.router import Router
from worker.core.workflows import WaitTimedOut, Workflow, WorkflowBusy
from worker.errors import MessageFailed, Permanent, Rejected, Retryable, WorkerError
from worker.settings import Settings
from worker.sql.rows import OutboxMessage

__all__ = [
    "Batch",
    "Context",
    "Delivery",
    "Handler",
    "HandlerKind",
    "MessageFailed",
    "OutboxMessage",
    "Permanent",
    "Rejected",
    "Retryable",
    "Router",
    "Settings",
    "WaitTimedOut",
    "WorkerError",
    "Workflow",
    "WorkflowBusy",
    "outbox",
]
