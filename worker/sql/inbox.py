"""The inbox's statements: claiming idempotency keys, completing or failing them, and
the steps of workflows that hold a key between transactions.

Each statement is a named constant written whole, with fixed ``$1..$n`` parameters, run on the
asyncpg connection of the caller's transaction (``driver.in_transaction``) as a prepared
statement; arrays and ``unnest`` carry a batch in one round trip.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from worker.core.codec import to_jsonable
from worker.sql.driver import Connection, in_transaction
from worker.sql.owners import owner_gone
from worker.sql.rows import MAX_ATTEMPTS, InboxEntry, InboxKey, KeyClaim

CLAIM_KEYS = """
WITH claims AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::bytea[], $4::text[], $5::text[])
         WITH ORDINALITY AS c(handler, key, fingerprint, message_id, routing_key, position)
), claimed AS (
    INSERT INTO inbox (handler, key, fingerprint, message_id, routing_key, status, owner,
                       lease_until)
    SELECT c.handler, c.key, c.fingerprint, c.message_id, c.routing_key,
           CASE WHEN $6::text IS NULL THEN 'completed' ELSE 'in_progress' END, $6::text,
           now() + make_interval(secs => $7::float8)
    FROM claims AS c
    ORDER BY c.position
    ON CONFLICT (handler, key) DO NOTHING
    RETURNING handler, key
)
SELECT c.handler, c.key, d.key IS NOT NULL AS claimed, e.status, e.fingerprint,
       e.result::text AS result, e.error
FROM claims AS c
LEFT JOIN claimed AS d ON d.handler = c.handler AND d.key = c.key
LEFT JOIN inbox AS e ON d.key IS NULL AND e.handler = c.handler AND e.key = c.key
"""

FETCH_KEYS = """
SELECT i.handler, i.key, i.status, i.fingerprint, i.result::text AS result, i.error
FROM unnest($1::text[], $2::text[]) AS k(handler, key)
JOIN inbox AS i ON i.handler = k.handler AND i.key = k.key
"""


COMPLETE_KEYS = """
UPDATE inbox AS i
SET status = 'completed', result = d.result::jsonb, owner = NULL, lease_until = NULL,
    updated_at = now()
FROM unnest($1::text[], $2::text[], $3::text[]) AS d(handler, key, result)
WHERE i.handler = d.handler AND i.key = d.key
"""
"""Mark keys completed with their results, given as three arrays (``completion_arrays``)."""


def completion_arrays(results: Sequence[tuple[str, str, Any]]) -> list[list[Any]]:
    """The three arrays ``COMPLETE_KEYS`` takes, from (handler, key, result): handlers, keys,
    results as JSON text."""
    return [
        [handler for handler, _, _ in results],
        [key for _, key, _ in results],
        [json.dumps(to_jsonable(result)) for _, _, result in results],
    ]


async def claim_keys(
    conn: Connection,
    claims: Sequence[KeyClaim],
    *,
    owner: str | None = None,
    lease: float | None = None,
) -> tuple[set[InboxKey], dict[InboxKey, InboxEntry]]:
    """Insert the claims' inbox rows in one statement; return the keys it claimed and the
    committed entries of those others had taken. The claims must have distinct keys, in the
    caller's lock order.

    A concurrent claim of the same key waits here until the other transaction ends: it then sees
    the committed row (not claimed) or, if the other rolled back, takes the key itself. A key
    committed by another transaction while this statement waited is neither claimed nor found
    (the statement's snapshot predates it), nor is one the janitor deleted meanwhile: claim such
    keys again.

    A unit of work's claim is written ``completed`` at once, with no result: nobody sees it
    before the commit, when it is true, and a handler that returns nothing then needs no second
    write of the row (``complete_keys`` stores a result). A workflow's claim is ``in_progress``,
    visible between its steps: it names its ``owner`` and holds the key for ``lease`` seconds.
    """
    driver = await in_transaction(conn)
    rows = await driver.fetch(
        CLAIM_KEYS,
        [c.handler for c in claims],
        [c.key for c in claims],
        [c.fingerprint for c in claims],
        [c.message_id for c in claims],
        [c.routing_key for c in claims],
        owner,
        lease,
    )
    claimed = {(row[0], row[1]) for row in rows if row[2]}
    existing = {(row[0], row[1]): _entry(row[3:]) for row in rows if row[3] is not None}
    return claimed, existing


def _entry(row: Sequence[Any]) -> InboxEntry:
    """An ``InboxEntry`` from (status, fingerprint, result as JSON text, error)."""
    status, fingerprint, result, error = row
    return InboxEntry(
        status, bytes(fingerprint), None if result is None else json.loads(result), error
    )


async def fetch_keys(conn: Connection, keys: Sequence[InboxKey]) -> dict[InboxKey, InboxEntry]:
    """The committed inbox rows of ``keys`` that exist."""
    driver = await in_transaction(conn)
    rows = await driver.fetch(FETCH_KEYS, [h for h, _ in keys], [k for _, k in keys])
    return {(row[0], row[1]): _entry(row[2:]) for row in rows}


async def complete_keys(conn: Connection, results: Sequence[tuple[str, str, Any]]) -> None:
    """Mark each (handler, key, result)'s key completed and store the handler's result with it,
    in one statement."""
    driver = await in_transaction(conn)
    await driver.execute(COMPLETE_KEYS, *completion_arrays(results))


RECORD_FAILURES = """
INSERT INTO inbox AS i (handler, key, fingerprint, status, error, attempts, message_id,
                        routing_key)
SELECT f.handler, f.key, f.fingerprint, 'failed', f.error, f.attempts, f.message_id,
       f.routing_key
FROM unnest($1::text[], $2::text[], $3::bytea[], $4::text[], $5::int4[], $6::text[], $7::text[])
     WITH ORDINALITY AS f(handler, key, fingerprint, error, attempts, message_id, routing_key,
                          position)
ORDER BY f.position
ON CONFLICT (handler, key) DO UPDATE
SET status = 'failed', error = excluded.error,
    attempts = least(i.attempts + excluded.attempts, $8::int4), owner = NULL,
    lease_until = NULL, updated_at = now()
WHERE i.status <> 'completed'
"""

FailedKey = tuple[KeyClaim, str, int]
"""A key to record as failed: its claim, the error, and the delivery's failed attempts."""


async def record_failures(conn: Connection, failures: Sequence[FailedKey]) -> None:
    """Mark each (claim, error, attempts)'s key failed with ``error``, unless its effect has
    committed meanwhile, in one statement in ``conn``'s transaction.

    A later delivery of such a key is then acknowledged without running the handler, until
    ``clear_failure`` (a DLQ replay) lets it run again. A key given twice is recorded once, with
    its last error; keys are written in (handler, key) order, the claims' lock order.
    """
    by_key = {claim.inbox_key: (claim, error, attempts) for claim, error, attempts in failures}
    rows = [by_key[key] for key in sorted(by_key)]
    driver = await in_transaction(conn)
    await driver.execute(
        RECORD_FAILURES,
        [claim.handler for claim, _, _ in rows],
        [claim.key for claim, _, _ in rows],
        [claim.fingerprint for claim, _, _ in rows],
        [error for _, error, _ in rows],
        [attempts for _, _, attempts in rows],
        [claim.message_id for claim, _, _ in rows],
        [claim.routing_key for claim, _, _ in rows],
        MAX_ATTEMPTS,
    )


async def record_failure(conn: Connection, claim: KeyClaim, *, error: str, attempts: int) -> None:
    """Mark (handler, key) failed with ``error`` unless its effect has committed meanwhile:
    ``record_failures`` of one."""
    await record_failures(conn, [(claim, error, attempts)])


CLEAR_FAILURE_OF_WORKFLOW = """
UPDATE inbox
SET status = 'in_progress', error = NULL, owner = NULL, lease_until = now()
WHERE handler = $1 AND key = $2 AND status = 'failed'
  AND (recovery_point IS NOT NULL
       OR EXISTS (SELECT FROM workflow_waits AS w WHERE w.handler = $1 AND w.key = $2))
RETURNING key
"""
"""A failed workflow with committed steps or waits back to in progress, its lease expired."""

CLEAR_FAILURE = """
DELETE FROM inbox WHERE handler = $1 AND key = $2 AND status = 'failed' RETURNING key
"""
"""Forget a failed key that has no committed steps and no waits."""


async def clear_failure(conn: Connection, handler: str, key: str) -> bool:
    """Forget that (handler, key) failed, so its next delivery runs; False if it had not.

    A workflow that had committed steps or registered waits goes back to in progress with its
    lease expired, so the next delivery takes it over and resumes after its last committed step,
    its waits resolved as they were (deleting the row would drop them with it: a wait whose
    signal came would wait again for a signal that came already).
    """
    driver = await in_transaction(conn)
    if await driver.fetchval(CLEAR_FAILURE_OF_WORKFLOW, handler, key) is not None:
        return True
    return await driver.fetchval(CLEAR_FAILURE, handler, key) is not None


TAKE_OVER_WORKFLOW = f"""
WITH free AS (
    SELECT handler, key FROM inbox
    WHERE handler = $1 AND key = $2 AND status = 'in_progress'
      AND (owner IS NULL OR lease_until <= now() OR {owner_gone("owner")})
    FOR UPDATE SKIP LOCKED
)
UPDATE inbox AS i
SET owner = $3, lease_until = now() + make_interval(secs => $4::float8),
    attempts = i.attempts + 1, updated_at = now()
FROM free
WHERE i.handler = free.handler AND i.key = free.key
RETURNING i.key
"""


async def take_over_workflow(
    conn: Connection, handler: str, key: str, *, owner: str, lease: float
) -> bool:
    """Make ``owner`` the owner of an in-progress workflow whose lease expired or was released,
    or whose owner is dead (``owners.owner_gone``: its process's session is gone).

    Compare-and-set: a workflow with a live owner, or one whose step transaction holds its row
    right now (``SKIP LOCKED``), is left alone and False is returned.
    """
    driver = await in_transaction(conn)
    return await driver.fetchval(TAKE_OVER_WORKFLOW, handler, key, owner, lease) is not None


HOLD_WORKFLOW = """
SELECT key FROM inbox
WHERE handler = $1 AND key = $2 AND owner = $3 AND status = 'in_progress'
FOR UPDATE
"""


async def hold_workflow(conn: Connection, handler: str, key: str, owner: str) -> bool:
    """Lock the workflow's inbox row until commit if ``owner`` still owns it; False if not.

    While a step's transaction holds the row, no other delivery can take the workflow over.
    """
    driver = await in_transaction(conn)
    return await driver.fetchval(HOLD_WORKFLOW, handler, key, owner) is not None


WORKFLOW_OUTPUTS = """
SELECT step, output::text FROM workflow_steps WHERE handler = $1 AND key = $2 ORDER BY position
"""


async def workflow_outputs(conn: Connection, handler: str, key: str) -> dict[str, Any]:
    """The outputs of the workflow's committed steps, by step name, in the order they ran."""
    driver = await in_transaction(conn)
    rows = await driver.fetch(WORKFLOW_OUTPUTS, handler, key)
    return {step: None if output is None else json.loads(output) for step, output in rows}


RECORD_STEP_OUTPUT = """
INSERT INTO workflow_steps (handler, key, step, position, output)
VALUES ($1, $2, $3, $4, $5::text::jsonb)
"""

ADVANCE_RECOVERY_POINT = """
UPDATE inbox
SET recovery_point = $3, lease_until = now() + make_interval(secs => $4::float8),
    updated_at = now()
WHERE handler = $1 AND key = $2
"""


async def record_step(
    conn: Connection,
    handler: str,
    key: str,
    *,
    step: str,
    position: int,
    output: Any,
    lease: float,
) -> None:
    """Store a step's output, make it the recovery point and renew the owner's lease."""
    driver = await in_transaction(conn)
    await driver.execute(
        RECORD_STEP_OUTPUT, handler, key, step, position, json.dumps(to_jsonable(output))
    )
    await driver.execute(ADVANCE_RECOVERY_POINT, handler, key, step, lease)


RELEASE_WORKFLOW = """
UPDATE inbox SET owner = NULL, lease_until = now()
WHERE handler = $1 AND key = $2 AND owner = $3 AND status = 'in_progress'
"""


async def release_workflow(conn: Connection, handler: str, key: str, owner: str) -> None:
    """Give up ownership at once (after a failed try) so the next delivery need not wait."""
    driver = await in_transaction(conn)
    await driver.execute(RELEASE_WORKFLOW, handler, key, owner)
