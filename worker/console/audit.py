"""``console_audit``: every action taken in the console, done or refused, with who took it, on
what, how many it touched and how it ended.

Invariant: an action's entry is written after the action, in a transaction of its own, with the
count of what it did: a failure mid-way is written with what was done before it (``outcome``
``failed: ...``). A refused action writes an entry and changes nothing else; a session refused
the same action for the same reason again within ``REFUSALS_WINDOW`` of that entry bumps its
``repeats`` instead, so a session posting refused actions in a loop adds one row per window,
not one per request. The janitor deletes entries older than ``console_audit_retention``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from worker.console.accounts import User
from worker.console.sessions import Session
from worker.console.state import Console
from worker.sql import audit

log = logging.getLogger(__name__)

REFUSALS_WINDOW = 600.0
"""Seconds after a refusal's entry during which the same refusal of its session bumps it."""
MAX_TARGET = 500
"""Characters of the target an entry keeps (a selection of many ids is cut, with its count)."""


async def record(
    console: Console,
    user: User,
    action: str,
    target: str,
    count: int,
    outcome: str,
    detail: Mapping[str, Any] | None = None,
) -> int:
    """Write one entry (see the module's invariant); its id."""
    if len(target) > MAX_TARGET:
        target = target[: MAX_TARGET - 1] + "…"
    async with console.engine.begin() as conn:
        entry = await audit.record(
            conn,
            actor=user.name,
            role=user.role.value,
            action=action,
            target=target,
            count=count,
            outcome=outcome,
            detail=detail,
        )
    log.info(
        "console: %s (%s) %s %s: %s, %d",
        user.name,
        user.role.value,
        action,
        target,
        outcome,
        count,
    )
    return entry


async def refused(console: Console, session: Session, action: str, why: str) -> None:
    """Write the entry of an action refused before it began, or count it on the session's last
    one for the same action and reason (see the module's invariant)."""
    outcome = f"refused: {why}"
    last = session.last_refusal
    if last is not None and last[:2] == (action, outcome):
        async with console.engine.begin() as conn:
            if await audit.repeat(conn, last[2], window=REFUSALS_WINDOW):
                log.debug("console: %s %s: %s again", session.user.name, action, outcome)
                return
    entry = await record(console, session.user, action, "", 0, outcome)
    session.last_refusal = (action, outcome, entry)
