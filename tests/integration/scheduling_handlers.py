"""A handler module for the scheduled-event crash tests: each ``reminder.requested`` schedules a
``sched.reminder`` event ``delay_ms`` later, with a message id derived from its key, and returns
when that event is due by the database's clock, so the test knows it without a clock of its own."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

from sqlalchemy import text

from worker import Context, Router

router = Router()

REMINDERS = uuid.UUID("6f1c0f7e-8a5e-4c52-9d8b-2f3c0e6a9b10")
"""The namespace of the reminders' message ids (``reminder_id``)."""


def reminder_id(key: str) -> uuid.UUID:
    """The message id of the reminder scheduled under idempotency key ``key``."""
    return uuid.uuid5(REMINDERS, key)


@router.handler("reminder.requested")
async def schedule_reminder(body: dict[str, Any], ctx: Context) -> dict[str, str]:
    delay = timedelta(milliseconds=body["delay_ms"])
    message_id = ctx.publish(
        "sched.reminder",
        {"n": body["n"]},
        message_id=reminder_id(ctx.key),
        ordering_key=body.get("ordering_key"),
        delay=delay,
    )
    # now() is the transaction's start, the instant the delay counts from
    due_at = await ctx.connection.scalar(
        text("SELECT now() + make_interval(secs => :seconds)"),
        {"seconds": delay.total_seconds()},
    )
    return {"message_id": str(message_id), "due_at": due_at.isoformat()}
