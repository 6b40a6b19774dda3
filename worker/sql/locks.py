"""Every advisory lock the worker takes, as the first key of PostgreSQL's two-key advisory locks.

Invariant: no two kinds of lock share a first key, so one kind can never block, or be mistaken
for, another (a janitor's sweep holding up the relay's scheduled events, say). The second key is
the kind's own (a hash of an ordering key, a handler's name, a correlation; 0 for a singleton).
Declared here, in one place, so that a new kind gets a number of its own; a unit test checks they
are distinct.
"""

from __future__ import annotations

ORDERING = 7_262_001
"""Transaction-scoped, per ordering key (``hashtext(key)``): serialises a key's outbox rows, so
they get their ids in commit order."""

JANITOR = 7_262_002
"""Session-level, second key 0: held by the one janitor sweeping at a time."""

CORRELATION = 7_262_003
"""Transaction-scoped, per (signal routing key, correlation): a signal and the registration of a
wait for it see each other, whichever commits second."""

MOVER = 7_262_004
"""Transaction-scoped, second key 0: one relay at a time moves due scheduled events."""

HANDLER_TURNS = 7_262_005
"""Transaction-scoped, per handler name (``hashtext(name)``): a contended handler's batches take
turns."""

WORKFLOW_OWNERS = 7_262_006
"""Session-level, per owning process (a random token, the first part of a workflow's ``owner``):
held on a connection of its own while the process runs workflows, so a workflow whose owner's
token is not held has a dead owner (``worker.sql.owners``)."""

CLASSES = (ORDERING, JANITOR, CORRELATION, MOVER, HANDLER_TURNS, WORKFLOW_OWNERS)
"""Every first key above."""
