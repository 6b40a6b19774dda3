"""Signals: messages that resume the workflows waiting for them (``wf.wait_for``).

``router.signal(routing_key, field=… | header=…)`` declares which routing key is a signal and
where its correlation is; the router registers ``Signal.handle`` as that routing key's plain
handler, so a signal is bound to the queue, deduplicated by the inbox and failed like any message.
In the signal's own unit of work, holding the (routing key, correlation) lock, it resolves every
open wait for it, cancels their timers and appends each workflow's resume message to the outbox;
when no wait is open it is buffered for a wait registered later. Exactly one of a wait's signal
and its timeout resolves it: ``worker.sql.waits`` says how.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from worker.core.codec import to_jsonable
from worker.core.context import Context
from worker.core.envelope import MAX_KEY_LENGTH, storable_text
from worker.errors import HandlerRegistrationError, Rejected
from worker.faults import WORKFLOW_RESUMED_BEFORE_COMMIT, crash_point
from worker.sql import waits

log = logging.getLogger(__name__)

RESUME_HEADER = "x-worker-resume"
"""On the message a signal publishes to resume a workflow: the name of the wait it resolved."""


class InvalidSignal(Rejected):
    """A signal without a usable correlation (missing, not a string or an integer, too long):
    its handler fails permanently, so it is parked (``handler-error``, this class named in
    ``x-worker-error``)."""


@dataclass(frozen=True)
class Signal:
    """A declared signal: its routing key, and the top-level ``field`` of its JSON object body
    or the ``header`` that holds its correlation (exactly one)."""

    routing_key: str
    field: str | None = None
    header: str | None = None

    def __post_init__(self) -> None:
        if (self.field is None) == (self.header is None):
            raise HandlerRegistrationError(
                f"signal {self.routing_key!r}: give exactly one of field= and header="
            )
        for name, value in (("field", self.field), ("header", self.header)):
            if value is not None and (not isinstance(value, str) or not value):
                raise HandlerRegistrationError(f"signal {self.routing_key!r}: {name} is empty")

    def correlation(self, body: Any, headers: Any) -> str:
        """The correlation this signal carries, as a string; ``InvalidSignal`` (permanent: the
        message is parked with its reason) when it is missing or unusable."""
        if self.field is not None:
            if not isinstance(body, dict) or self.field not in body:
                raise InvalidSignal(f"signal has no field {self.field!r} in its JSON object body")
            where, value = f"field {self.field!r}", body[self.field]
        else:
            assert self.header is not None
            if self.header not in headers:
                raise InvalidSignal(f"signal has no header {self.header!r}")
            where, value = f"header {self.header!r}", headers[self.header]
            if isinstance(value, bytes | bytearray):  # an AMQP byte array
                value = bytes(value).decode("utf-8", errors="replace")
        return correlation_text(value, where)

    async def handle(self, body: Any, ctx: Context) -> dict[str, Any]:
        """Resolve the open waits for this signal's correlation, or buffer it; its stored result
        says which: ``{"resumed": [[handler, key, wait], …]}`` or ``{"buffered": true}``."""
        body = to_jsonable(body)  # (a body type's model, validated, as the JSON it stores)
        correlation = self.correlation(body, ctx.envelope.delivery.headers)
        event = {"body": body, "message_id": ctx.message_id}
        await waits.lock_correlation(ctx.connection, self.routing_key, correlation)
        resolved = await waits.resolve_by_signal(
            ctx.connection, self.routing_key, correlation, event
        )
        for wait in resolved:
            if wait.timer_id is not None:
                await ctx.cancel(wait.timer_id)
            ctx.outbox.append(
                dataclasses.replace(
                    wait.resume, headers={**wait.resume.headers, RESUME_HEADER: wait.name}
                )
            )
            log.info(
                "signal %s %s resumes wait %s of workflow %s of %s",
                self.routing_key,
                correlation,
                wait.name,
                wait.key,
                wait.handler,
            )
        if not resolved:
            await waits.buffer_signal(
                ctx.connection, self.routing_key, correlation, ctx.message_id, event
            )
            log.info(
                "signal %s %s found no open wait: buffered for a later one",
                self.routing_key,
                correlation,
            )
        crash_point(WORKFLOW_RESUMED_BEFORE_COMMIT)
        if not resolved:
            return {"buffered": True}
        return {"resumed": [[w.handler, w.key, w.name] for w in resolved]}


def correlation_text(value: object, where: str = "correlation") -> str:
    """``value`` as a correlation the waits can store: a non-empty string, or an integer as its
    decimal string, of at most ``MAX_KEY_LENGTH`` characters with no NUL; else
    ``InvalidSignal``."""
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise InvalidSignal(f"signal's {where} is not a string or an integer")
    text = str(value)
    if not text or not storable_text(text):
        raise InvalidSignal(
            f"signal's {where} is empty, has a NUL character or is longer than "
            f"{MAX_KEY_LENGTH} characters"
        )
    return text
