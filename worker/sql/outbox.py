"""The outbox's statements: appending events in the caller's transaction (ordering-key
locks, NOTIFY), and claiming, deleting or failing rows for a relay.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Select,
    Text,
    all_,
    and_,
    any_,
    bindparam,
    delete,
    exists,
    func,
    or_,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY, insert
from sqlalchemy.dialects.postgresql.asyncpg import dialect as asyncpg_dialect
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.expression import ClauseElement

from worker.core.codec import to_jsonable
from worker.sql.driver import Connection, in_transaction
from worker.sql.rows import OutboxMessage
from worker.sql.tables import outbox, outbox_parked

OUTBOX_CHANNEL = "worker_outbox"
"""The LISTEN/NOTIFY channel relays wait on; a notification is only a hint to look now."""

ORDERING_LOCK_CLASS = 7_262_001
"""First key of the transaction-scoped advisory locks that serialize an ordering key's rows."""

RETRY_DELAY_CAP_SECONDS = 300.0
"""A failed outbox row is retried at least this often, however many attempts it has had."""


NOTIFY_RELAYS = f"pg_notify('{OUTBOX_CHANNEL}', '')"
"""The NOTIFY that wakes listening relays; delivered at commit, once however often it is sent."""

LOCK_ORDERING_KEYS = f"""
SELECT count(pg_advisory_xact_lock({ORDERING_LOCK_CLASS}, hashtext(k.key)))
FROM unnest($1::text[]) WITH ORDINALITY AS k(key, position)
"""
"""Take the advisory lock of each ordering key in the array ``$1``, in the array's order, held
until commit (an aggregate: one row)."""

LOCK_ORDERING_KEYS_AND_NOTIFY = f"""
SELECT {NOTIFY_RELAYS}, count(pg_advisory_xact_lock({ORDERING_LOCK_CLASS}, hashtext(k.key)))
FROM unnest($1::text[]) WITH ORDINALITY AS k(key, position)
"""
"""``LOCK_ORDERING_KEYS``, and one NOTIFY for relays (the aggregate makes it run once)."""

APPEND_OUTBOX = """
INSERT INTO outbox (message_id, exchange, routing_key, body, content_type, headers,
                    correlation_id, causation_id, ordering_key)
SELECT m.message_id, m.exchange, m.routing_key, m.body, m.content_type, m.headers::jsonb,
       m.correlation_id, m.causation_id, m.ordering_key
FROM unnest($1::uuid[], $2::text[], $3::text[], $4::bytea[], $5::text[],
            $6::text[], $7::text[], $8::text[], $9::text[])
     WITH ORDINALITY AS m(message_id, exchange, routing_key, body, content_type, headers,
                          correlation_id, causation_id, ordering_key, position)
ORDER BY m.position
"""
"""Insert the events given as nine arrays (``event_arrays``), in the arrays' order."""


def event_arrays(messages: Sequence[OutboxMessage]) -> list[list[Any]]:
    """The nine arrays ``APPEND_OUTBOX`` takes, one element per message (message ids, exchanges,
    routing keys, bodies, content types, headers as JSON text, correlation ids, causation ids,
    ordering keys)."""
    return [
        [m.message_id for m in messages],
        [m.exchange for m in messages],
        [m.routing_key for m in messages],
        [m.body for m in messages],
        [m.content_type for m in messages],
        [json.dumps(to_jsonable(m.headers)) for m in messages],
        [m.correlation_id for m in messages],
        [m.causation_id for m in messages],
        [m.ordering_key for m in messages],
    ]


def ordering_keys_of(messages: Sequence[OutboxMessage]) -> list[str]:
    """The distinct ordering keys of ``messages``, sorted: the order their locks are taken in, so
    that two transactions cannot deadlock on them."""
    return sorted({m.ordering_key for m in messages if m.ordering_key is not None})


async def lock_ordering_keys(
    conn: Connection, ordering_keys: Iterable[str], *, notify: bool
) -> None:
    """Take the ordering keys' advisory locks, held until commit, in sorted order (so two
    transactions cannot deadlock on them), and with ``notify`` queue one NOTIFY for relays; one
    round trip, of one statement text whatever the keys."""
    keys = sorted(ordering_keys)
    if not keys and not notify:
        return
    driver = await in_transaction(conn)
    # the locks are taken in the array's order; the aggregate makes the NOTIFY run once
    await driver.execute(LOCK_ORDERING_KEYS_AND_NOTIFY if notify else LOCK_ORDERING_KEYS, keys)


async def append_outbox(
    conn: Connection, messages: Sequence[OutboxMessage], *, notify: bool = False
) -> None:
    """Insert the events a handler recorded, in the order it recorded them, in one statement.

    For each ordering key among them, an advisory lock held until commit is taken first (keys
    sorted, so two transactions cannot deadlock on them). Rows of one ordering key therefore get
    their ids in commit order, and a row is only ever visible after every earlier row of its key.
    With ``notify``, one NOTIFY on ``OUTBOX_CHANNEL`` is delivered to listening relays at commit.
    """
    if not messages:
        return
    driver = await in_transaction(conn)
    await lock_ordering_keys(driver, ordering_keys_of(messages), notify=notify)
    await driver.execute(APPEND_OUTBOX, *event_arrays(messages))


@dataclass(frozen=True)
class OutboxRow:
    """An outbox row claimed by a relay: everything needed to publish it."""

    id: int
    message_id: uuid.UUID
    exchange: str
    routing_key: str
    body: bytes
    content_type: str
    headers: dict[str, Any]
    correlation_id: str | None
    causation_id: str | None
    ordering_key: str | None
    attempts: int
    created_at: datetime


_OUTBOX_ROW_COLUMNS = [outbox.c[name] for name in OutboxRow.__dataclass_fields__]


def _claim_statement() -> Select[Any]:
    """``claim_outbox``'s one statement: lock due rows, then keep each key's unbroken run.

    The ``claimed`` CTE (``MATERIALIZED``: it runs, and locks, exactly once) locks up to
    ``:limit`` due rows in id order, skipping rows other transactions hold, every row of an
    ordering key in ``:busy``, and every row of a key with an older row waiting for its retry
    (those could only be held back, and a long run of them would fill every claim's limit and
    stall all other keys until the failed row is published or parked). The outer query returns
    the rows of no key, and a key's row only when no older row of its key is left outside
    ``claimed`` (held by another relay, committed since the CTE looked, or beyond the limit).
    """
    waiting = outbox.alias("waiting")
    behind_a_retry = exists().where(
        waiting.c.ordering_key == outbox.c.ordering_key,
        waiting.c.id < outbox.c.id,
        waiting.c.available_at > func.now(),
    )
    claimed = (
        select(*_OUTBOX_ROW_COLUMNS)
        .where(
            outbox.c.available_at <= func.now(),
            or_(
                outbox.c.ordering_key.is_(None),
                and_(
                    outbox.c.ordering_key != all_(bindparam("busy", type_=ARRAY(Text))),
                    ~behind_a_retry,
                ),
            ),
        )
        .order_by(outbox.c.id)
        .limit(bindparam("limit"))
        .with_for_update(skip_locked=True, of=outbox)
        .cte("claimed")
        .prefix_with("MATERIALIZED")
    )
    older = outbox.alias("older")
    left_behind = exists().where(
        older.c.ordering_key == claimed.c.ordering_key,
        older.c.id < claimed.c.id,
        older.c.id.not_in(select(claimed.c.id)),
    )
    return (
        select(claimed)
        .where(or_(claimed.c.ordering_key.is_(None), ~left_behind))
        .order_by(claimed.c.id)
    )


def for_driver(statement: ClauseElement, *order: str) -> str:
    """``statement`` compiled once for asyncpg, to run on the driver as a prepared statement
    (no SQLAlchemy execution layer per call); its ``$n`` parameters must be ``order``."""
    compiled = statement.compile(dialect=asyncpg_dialect())  # type: ignore[no-untyped-call]
    assert isinstance(compiled, SQLCompiler)
    assert tuple(compiled.positiontup or ()) == order, compiled.positiontup
    return str(compiled)


CLAIM_OUTBOX = for_driver(_claim_statement(), "busy", "limit")


async def claim_outbox(
    conn: Connection, limit: int, *, busy: Collection[str] = ()
) -> list[OutboxRow]:
    """Lock up to ``limit`` due rows in id order, skipping rows other relays hold and the rows
    of the ordering keys in ``busy`` (the keys this relay still has in flight); one round trip.

    Of an ordering key's rows only an unbroken run from the key's oldest row is returned: a row
    whose older sibling is held by another relay, waiting for a retry, or not claimed here stays
    locked but unreturned, so no relay can publish a key's rows out of order. A ``busy`` key's
    rows are neither locked nor counted against ``limit``.
    """
    driver = await in_transaction(conn)
    rows = await driver.fetch(CLAIM_OUTBOX, list(busy), limit)
    return [_outbox_row(row) for row in rows]


def _outbox_row(row: Sequence[Any]) -> OutboxRow:
    """A claimed row as ``OutboxRow`` (its columns are the fields, in order); ``headers`` as a
    dict whether or not the connection decodes ``jsonb`` (SQLAlchemy's do, a bare one does not)."""
    fields = list(row)
    headers = fields[6]
    if isinstance(headers, str):
        fields[6] = json.loads(headers)
    return OutboxRow(*fields)


_IDS_IN = outbox.c.id == any_(bindparam("ids", type_=ARRAY(BigInteger)))
"""``outbox.id = ANY(:ids)``: one statement text however many ids (a statement whose text
changes with its batch is compiled and prepared again every time)."""

DELETE_OUTBOX = for_driver(delete(outbox).where(_IDS_IN), "ids")


async def delete_outbox(conn: Connection, ids: Sequence[int]) -> None:
    """Delete published rows (in the transaction that claimed them), in one statement."""
    if ids:
        driver = await in_transaction(conn)
        await driver.execute(DELETE_OUTBOX, list(ids))


async def fail_outbox(
    conn: AsyncConnection,
    errors: Mapping[int, str],
    *,
    max_attempts: int,
    retry_delay: float,
) -> list[int]:
    """Count a failed publish of each row in ``errors`` and move it out by exponential backoff.

    The n-th failure makes a row wait ``retry_delay * 2**(n-1)`` seconds (at most
    ``RETRY_DELAY_CAP_SECONDS``); the ``max_attempts``-th moves it to ``outbox_parked``. Returns
    the ids of the rows parked.
    """
    if not errors:
        return []
    delay = func.least(
        RETRY_DELAY_CAP_SECONDS,
        bindparam("retry_delay") * func.power(2, outbox.c.attempts),
    )
    await conn.execute(
        update(outbox)
        .where(outbox.c.id == bindparam("row_id"))
        .values(
            attempts=outbox.c.attempts + 1,
            last_error=bindparam("error"),
            available_at=func.now() + func.make_interval(0, 0, 0, 0, 0, 0, delay),
        ),
        [{"row_id": i, "error": e, "retry_delay": retry_delay} for i, e in errors.items()],
    )
    columns = [c.name for c in outbox_parked.c if c.name != "parked_at"]
    moved = (
        delete(outbox)
        .where(_IDS_IN, outbox.c.attempts >= max_attempts)
        .returning(*(outbox.c[name] for name in columns))
        .cte("moved")
    )
    park = (
        insert(outbox_parked)
        .from_select(columns, select(*(moved.c[name] for name in columns)))
        .returning(outbox_parked.c.id)
    )
    return [row_id for (row_id,) in await conn.execute(park, {"ids": list(errors)})]
