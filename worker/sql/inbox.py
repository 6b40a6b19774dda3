"""The inbox's statements: claiming idempotency keys, completing or failing them, and
the steps of workflows that hold a key between transactions.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    Float,
    Text,
    bindparam,
    cast,
    delete,
    func,
    or_,
    select,
    tuple_,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, insert
from sqlalchemy.ext.asyncio import AsyncConnection

from worker.core.codec import to_jsonable
from worker.sql.rows import MAX_ATTEMPTS, InboxEntry, InboxKey, KeyClaim
from worker.sql.tables import inbox, workflow_steps


async def claim_keys(
    conn: AsyncConnection,
    claims: Sequence[KeyClaim],
    *,
    owner: str | None = None,
    lease: float | None = None,
) -> set[InboxKey]:
    """Insert the claims' inbox rows in one statement; return the keys it claimed (the others
    were taken). The claims must have distinct keys, in the caller's lock order.

    A concurrent claim of the same key waits here until the other transaction ends: it then sees
    the committed row (not claimed) or, if the other rolled back, takes the key itself. A
    workflow's claim names its ``owner`` and holds the key for ``lease`` seconds.
    """
    stmt = (
        insert(inbox)
        .values(
            status="in_progress",
            owner=owner,
            lease_until=None if lease is None else func.now() + interval(lease),
        )
        .on_conflict_do_nothing(index_elements=[inbox.c.handler, inbox.c.key])
        .returning(inbox.c.handler, inbox.c.key)
    )
    rows = [
        {
            "handler": claim.handler,
            "key": claim.key,
            "fingerprint": claim.fingerprint,
            "message_id": claim.message_id,
            "routing_key": claim.routing_key,
        }
        for claim in claims
    ]
    # executemany: SQLAlchemy sends the rows as one multi-row INSERT of a cached statement
    return {(row.handler, row.key) for row in await conn.execute(stmt, rows)}


def interval(value: float) -> Any:
    """An SQL interval of ``value`` seconds."""
    return func.make_interval(0, 0, 0, 0, 0, 0, bindparam(None, value, type_=Float))


async def fetch_keys(conn: AsyncConnection, keys: Sequence[InboxKey]) -> dict[InboxKey, InboxEntry]:
    """The committed inbox rows of ``keys`` that exist."""
    stmt = select(
        inbox.c.handler,
        inbox.c.key,
        inbox.c.status,
        inbox.c.fingerprint,
        inbox.c.result,
        inbox.c.error,
    ).where(tuple_(inbox.c.handler, inbox.c.key).in_(keys))
    return {
        (row.handler, row.key): InboxEntry(
            row.status, bytes(row.fingerprint), row.result, row.error
        )
        for row in await conn.execute(stmt)
    }


async def complete_keys(conn: AsyncConnection, results: Sequence[tuple[str, str, Any]]) -> None:
    """Mark each (handler, key, result)'s key completed and store the handler's result with it,
    in one statement."""
    done = (
        func.unnest(
            bindparam("handlers", type_=ARRAY(Text)),
            bindparam("keys", type_=ARRAY(Text)),
            bindparam("results", type_=ARRAY(Text)),
        )
        .table_valued("handler", "key", "result")
        .render_derived()
    )
    stmt = (
        update(inbox)
        .where(inbox.c.handler == done.c.handler, inbox.c.key == done.c.key)
        .values(
            status="completed",
            result=cast(done.c.result, JSONB),
            owner=None,
            lease_until=None,
            updated_at=func.now(),
        )
    )
    # one statement of a fixed text, the rows as three arrays
    params = {
        "handlers": [handler for handler, _, _ in results],
        "keys": [key for _, key, _ in results],
        "results": [json.dumps(to_jsonable(result)) for _, _, result in results],
    }
    await conn.execute(stmt, params)


async def record_failure(
    conn: AsyncConnection, claim: KeyClaim, *, error: str, attempts: int
) -> None:
    """Mark (handler, key) failed with ``error`` unless its effect has committed meanwhile.

    A later delivery of the key is then acknowledged without running the handler, until
    ``clear_failure`` (a DLQ replay) lets it run again.
    """
    stmt = insert(inbox).values(
        handler=claim.handler,
        key=claim.key,
        fingerprint=claim.fingerprint,
        status="failed",
        error=error,
        attempts=attempts,
        message_id=claim.message_id,
        routing_key=claim.routing_key,
    )
    await conn.execute(
        stmt.on_conflict_do_update(
            index_elements=[inbox.c.handler, inbox.c.key],
            set_={
                "status": "failed",
                "error": stmt.excluded.error,
                "attempts": func.least(inbox.c.attempts + stmt.excluded.attempts, MAX_ATTEMPTS),
                "owner": None,
                "lease_until": None,
                "updated_at": func.now(),
            },
            where=inbox.c.status != "completed",
        )
    )


async def clear_failure(conn: AsyncConnection, handler: str, key: str) -> bool:
    """Forget that (handler, key) failed, so its next delivery runs; False if it had not.

    A workflow that had committed steps goes back to in progress with its lease expired, so the
    next delivery takes it over and resumes after its last committed step.
    """
    failed = (inbox.c.handler == handler, inbox.c.key == key, inbox.c.status == "failed")
    resumed = await conn.execute(
        update(inbox)
        .where(*failed, inbox.c.recovery_point.is_not(None))
        .values(status="in_progress", error=None, owner=None, lease_until=func.now())
        .returning(inbox.c.key)
    )
    if resumed.first() is not None:
        return True
    deleted = await conn.execute(delete(inbox).where(*failed).returning(inbox.c.key))
    return deleted.first() is not None


async def take_over_workflow(
    conn: AsyncConnection, handler: str, key: str, *, owner: str, lease: float
) -> bool:
    """Make ``owner`` the owner of an in-progress workflow whose lease expired or was released.

    Compare-and-set: a workflow with a live lease, or one whose step transaction holds its row
    right now (``SKIP LOCKED``), is left alone and False is returned.
    """
    free = (
        select(inbox.c.handler, inbox.c.key)
        .where(
            inbox.c.handler == handler,
            inbox.c.key == key,
            inbox.c.status == "in_progress",
            or_(inbox.c.owner.is_(None), inbox.c.lease_until <= func.now()),
        )
        .with_for_update(skip_locked=True)
        .cte("free")
    )
    taken = await conn.execute(
        update(inbox)
        .where(inbox.c.handler == free.c.handler, inbox.c.key == free.c.key)
        .values(
            owner=owner,
            lease_until=func.now() + interval(lease),
            attempts=inbox.c.attempts + 1,
            updated_at=func.now(),
        )
        .returning(inbox.c.key)
    )
    return taken.first() is not None


async def hold_workflow(conn: AsyncConnection, handler: str, key: str, owner: str) -> bool:
    """Lock the workflow's inbox row until commit if ``owner`` still owns it; False if not.

    While a step's transaction holds the row, no other delivery can take the workflow over.
    """
    stmt = (
        select(inbox.c.key)
        .where(
            inbox.c.handler == handler,
            inbox.c.key == key,
            inbox.c.owner == owner,
            inbox.c.status == "in_progress",
        )
        .with_for_update()
    )
    return (await conn.execute(stmt)).first() is not None


async def workflow_outputs(conn: AsyncConnection, handler: str, key: str) -> dict[str, Any]:
    """The outputs of the workflow's committed steps, by step name, in the order they ran."""
    stmt = (
        select(workflow_steps.c.step, workflow_steps.c.output)
        .where(workflow_steps.c.handler == handler, workflow_steps.c.key == key)
        .order_by(workflow_steps.c.position)
    )
    return {step: output for step, output in await conn.execute(stmt)}


async def record_step(
    conn: AsyncConnection,
    handler: str,
    key: str,
    *,
    step: str,
    position: int,
    output: Any,
    lease: float,
) -> None:
    """Store a step's output, make it the recovery point and renew the owner's lease."""
    await conn.execute(
        insert(workflow_steps).values(
            handler=handler, key=key, step=step, position=position, output=to_jsonable(output)
        )
    )
    await conn.execute(
        update(inbox)
        .where(inbox.c.handler == handler, inbox.c.key == key)
        .values(
            recovery_point=step,
            lease_until=func.now() + interval(lease),
            updated_at=func.now(),
        )
    )


async def release_workflow(conn: AsyncConnection, handler: str, key: str, owner: str) -> None:
    """Give up ownership at once (after a failed try) so the next delivery need not wait."""
    await conn.execute(
        update(inbox)
        .where(
            inbox.c.handler == handler,
            inbox.c.key == key,
            inbox.c.owner == owner,
            inbox.c.status == "in_progress",
        )
        .values(owner=None, lease_until=func.now())
    )
