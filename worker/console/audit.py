"""``console_audit``: every action taken in the console, done or refused, with who took it, on
what, how many it touched and how it ended.

Invariant: an action's entry is written after the action, in a transaction of its own, with the
count of what it did: a failure mid-way is written with what was done before it (``outcome``
``failed: ...``). A refused action writes an entry and changes nothing else.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from worker.console.accounts import User
from worker.console.state import Console
from worker.sql import audit

log = logging.getLogger(__name__)

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


async def refused(console: Console, user: User, action: str, why: str) -> None:
    """Write the entry of an action refused before it began."""
    await record(console, user, action, "", 0, f"refused: {why}")
