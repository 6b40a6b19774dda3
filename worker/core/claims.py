"""Claiming idempotency keys in the caller's transaction, and what a key already taken means.

The claim is an ``INSERT … ON CONFLICT DO NOTHING`` in the unit of work's own transaction: a
second delivery of a key in flight waits on the uncommitted row, then finds it committed (a
duplicate) or rolled back (and claims it itself). So a key's effect commits at most once, and no
in-progress row of a plain unit of work is ever visible to anyone else.
"""

from __future__ import annotations

from collections.abc import Sequence

from worker.core.envelope import Envelope
from worker.core.outcomes import Outcome
from worker.errors import KeyReused
from worker.sql import inbox
from worker.sql.driver import Connection
from worker.sql.rows import InboxEntry, InboxKey

Settled = Outcome | KeyReused
"""A message's end in a batch that committed: an outcome, or the key-reused rejection."""


async def claim_all(
    conn: Connection,
    envelopes: Sequence[Envelope],
    *,
    owner: str | None = None,
    lease: float | None = None,
) -> dict[InboxKey, InboxEntry | None]:
    """Claim the envelopes' keys (distinct, in lock order) in ``conn``'s transaction: None for
    each key claimed, else the key's committed entry."""
    claims: dict[InboxKey, InboxEntry | None] = {}
    pending = list(envelopes)
    while pending:
        claimed, existing = await inbox.claim_keys(
            conn, [e.claim for e in pending], owner=owner, lease=lease
        )
        claims.update(dict.fromkeys(claimed))
        claims.update(existing)
        # committed while the claim waited on it, or deleted by the janitor: claim it again
        pending = [e for e in pending if e.inbox_key not in claims]
    return claims


async def claim(
    conn: Connection,
    envelope: Envelope,
    *,
    owner: str | None = None,
    lease: float | None = None,
) -> InboxEntry | None:
    """Claim the envelope's key in ``conn``'s transaction: None when claimed, else the key's
    committed entry. Raises ``KeyReused`` when that entry has another fingerprint."""
    existing = (await claim_all(conn, [envelope], owner=owner, lease=lease))[envelope.inbox_key]
    if existing is not None and existing.fingerprint != envelope.fingerprint:
        raise KeyReused()
    return existing


def duplicate(existing: InboxEntry) -> Outcome:
    """The outcome of a delivery whose key was completed, or failed, before."""
    if existing.status == "failed":
        return Outcome.DUPLICATE_OF_FAILED  # not re-run until a DLQ replay clears it
    return Outcome.DUPLICATE


def settled_against(existing: InboxEntry | None, envelope: Envelope, first: Envelope) -> Settled:
    """The end of a delivery that does not run: its key's committed entry decides, or, for a
    repeat inside the batch, the delivery of that key that ran (``first``)."""
    fingerprint = first.fingerprint if existing is None else existing.fingerprint
    if fingerprint != envelope.fingerprint:
        return KeyReused()
    return Outcome.DUPLICATE if existing is None else duplicate(existing)
