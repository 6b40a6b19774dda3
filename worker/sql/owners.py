"""Who owns a workflow, and whether that owner still lives, told by PostgreSQL itself.

Invariant: a workflow's ``owner`` is ``<token>/<delivery>/<run>``. ``token`` names a
session-level advisory lock (``locks.WORKFLOW_OWNERS``) that the owning process holds on a
connection of its own for as long as it runs workflows; PostgreSQL drops it the moment that
session ends (the process killed, its connection gone), so an owner whose token is not held is
dead now, not when its lease runs out. ``delivery`` tells the owning delivery's message apart
(its message id's digest), so a redelivery of that very message is never taken for a copy the
owner carries. An owner in another form (none of these parts) lives until its lease runs out.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import datetime

from worker.sql import locks
from worker.sql.driver import Connection, in_transaction

TOKEN_PATTERN = "^([0-9]{1,10})/"
"""The owner's token, as a regular expression's group (no match: an owner of another form)."""

DELIVERY_PATTERN = "^[0-9]{1,10}/([^/]*)/"
"""The owner's delivery digest, as a regular expression's group."""


def owner_gone(owner: str) -> str:
    """SQL, true when the owner in column ``owner`` has a token and nobody holds its lock in
    this database: its process or its session is gone."""
    return f"""(substring({owner} from '{TOKEN_PATTERN}') IS NOT NULL AND NOT EXISTS (
        SELECT FROM pg_locks AS l
        WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
          AND l.classid = {locks.WORKFLOW_OWNERS}
          AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
          AND l.objid::text = substring({owner} from '{TOKEN_PATTERN}')))"""


def delivery_tag(message_id: str | None) -> str:
    """The owner's middle part for a delivery with ``message_id`` (empty without one)."""
    if message_id is None:
        return ""
    return hashlib.sha256(message_id.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def owner_of(token: int, message_id: str | None, run: str) -> str:
    """The ``owner`` a run writes: its process's token, its delivery's digest, its own id."""
    return f"{token}/{delivery_tag(message_id)}/{run}"


TRY_LOCK = f"SELECT pg_try_advisory_lock({locks.WORKFLOW_OWNERS}, $1::int4)"
UNLOCK = f"SELECT pg_advisory_unlock({locks.WORKFLOW_OWNERS}, $1::int4)"


async def try_lock_token(conn: Connection, token: int) -> bool:
    """Hold ``token``'s lock for the session of ``conn`` (beyond its transaction); False when
    another session holds it."""
    driver = await in_transaction(conn)
    return bool(await driver.fetchval(TRY_LOCK, token))


async def unlock_token(conn: Connection, token: int) -> None:
    """Let go of ``token``'s lock held by the session of ``conn``."""
    driver = await in_transaction(conn)
    await driver.fetchval(UNLOCK, token)


CARRIED_BY_ANOTHER = f"""
SELECT lease_until > now() AND NOT {owner_gone("owner")}
       AND ($3::text IS NULL OR substring(owner from '{DELIVERY_PATTERN}') IS DISTINCT FROM $3)
FROM inbox
WHERE handler = $1 AND key = $2 AND status = 'in_progress'
  AND substring(owner from '{DELIVERY_PATTERN}') IS NOT NULL
"""
"""Whether workflow (``$1``, ``$2``) is owned by a live run, of a delivery whose digest is not
``$3`` (NULL: of any); no row when nobody owns it or its owner is of another form."""


async def carried_by_another(
    conn: Connection, handler: str, key: str, *, redelivered: bool, message_id: str | None
) -> bool:
    """Whether a live run owns the workflow for another delivery than this one: that run's own
    delivery stays unacked while it runs, so if the run dies its redelivery takes over. A
    delivery that is not ``redelivered`` was never handed to that run; one that is, with the
    owner's message id, may be the owner's own delivery come back (its channel closed under
    the live run): then it is not another's."""
    driver = await in_transaction(conn)
    own = delivery_tag(message_id) if redelivered else None
    return bool(await driver.fetchval(CARRIED_BY_ANOTHER, handler, key, own))


@dataclass(frozen=True)
class Orphan:
    """A workflow in progress whose lease ran out while it was owned, and whose owner is dead
    (its process's lock is not held) or of a form that cannot be told (``gone`` False)."""

    handler: str
    key: str
    recovery_point: str | None
    owner: str
    lease_until: datetime
    gone: bool


ORPHANED = f"""status = 'in_progress' AND owner IS NOT NULL AND lease_until <= now()
  AND (substring(owner from '{TOKEN_PATTERN}') IS NULL OR {owner_gone("owner")})"""
"""An inbox row's condition of an orphaned workflow (``Orphan``)."""

ORPHAN_COLUMNS = f"handler, key, recovery_point, owner, lease_until, {owner_gone('owner')}"

ORPHANS = f"""
SELECT {ORPHAN_COLUMNS}, count(*) OVER () AS total
FROM inbox
WHERE {ORPHANED}
ORDER BY updated_at, handler, key
LIMIT $1
"""
"""The ``$1`` least recently advanced orphaned workflows, and how many there are."""

ORPHAN = f"""
SELECT {ORPHAN_COLUMNS} FROM inbox WHERE handler = $1 AND key = $2 AND {ORPHANED}
"""


async def orphaned_workflows(conn: Connection, limit: int) -> tuple[int, list[Orphan]]:
    """Workflows whose owner died without letting go and whose lease ran out: any delivery of
    theirs would have taken them over, so none is coming (``worker workflows resume``)."""
    driver = await in_transaction(conn)
    rows = await driver.fetch(ORPHANS, limit)
    return (int(rows[0]["total"]) if rows else 0), [Orphan(*row[:6]) for row in rows]


async def orphan(conn: Connection, handler: str, key: str) -> Orphan | None:
    """The workflow (``handler``, ``key``) if it is orphaned, by its primary key; else None."""
    driver = await in_transaction(conn)
    row = await driver.fetchrow(ORPHAN, handler, key)
    return None if row is None else Orphan(*row)


OWNER_STATE = f"""
SELECT status, owner,
       owner IS NOT NULL AND CASE WHEN substring(owner from '{TOKEN_PATTERN}') IS NULL
                                  THEN lease_until > now()
                                  ELSE NOT {owner_gone("owner")} END AS alive
FROM inbox WHERE handler = $1 AND key = $2
FOR UPDATE
"""


@dataclass(frozen=True)
class OwnerState:
    """A key's status and owner, and whether that owner is alive: its token's lock held (its
    lease may have run out in a long step), or for an owner of another form, its lease."""

    status: str
    owner: str | None
    alive: bool


async def owner_state(conn: Connection, handler: str, key: str) -> OwnerState | None:
    """The key's status and owner, its row locked until commit; None when there is no key."""
    driver = await in_transaction(conn)
    row = await driver.fetchrow(OWNER_STATE, handler, key)
    return None if row is None else OwnerState(row[0], row[1], bool(row[2]))


RELEASE_DEAD = """
UPDATE inbox SET owner = NULL, lease_until = now(), updated_at = now()
WHERE handler = $1 AND key = $2 AND status = 'in_progress'
"""


async def release_dead(conn: Connection, handler: str, key: str) -> None:
    """Release the workflow (checked first, with ``owner_state``, to have no live owner)."""
    driver = await in_transaction(conn)
    await driver.execute(RELEASE_DEAD, handler, key)
