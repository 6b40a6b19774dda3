"""``/inbox``: an inbox key looked up by its handler and key: its status, attempts, fingerprint,
stored result or error and timestamps, and for a workflow its committed steps and its waits
(what it waits for, until when, and how each wait ended) and, when its owner died holding it
past its lease, that and the command that resumes it; without a key asked for, the keys updated
last.

Invariant: nothing here reads more than a primary key or an index range with a LIMIT
(``worker.sql.lookup``): the key by ``inbox``'s primary key, its steps and waits by the prefix
of theirs, the recent keys from the end of the ``updated_at`` index (whether the key's owner is
alive, from ``pg_locks``). There is no list of handlers (that would read the whole inbox): the
handler is typed, as ``worker workflows`` prints it. A stored result, error, step output or event
is cut in the database, with a link to see more, capped. Nothing changes.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Annotated

from fastapi import APIRouter, Query
from starlette.requests import Request
from starlette.responses import Response

from worker.console.guard import Viewer
from worker.console.state import console_of
from worker.console.templating import render
from worker.ops.workflows import resume_command
from worker.sql import lookup, owners

router = APIRouter()

PREVIEW_CHARS = 4096
"""Characters of a stored result or error the lookup shows at first."""
CELL_CHARS = 300
"""Characters of a step's output or a wait's event a table shows at first."""
FULL_CHARS = 1 << 20
"""Characters of a stored result or error shown at most when asked for all."""
FULL_CELL_CHARS = 16 * 1024
"""Characters of each step's output or wait's event shown at most when asked for all."""
MAX_STEPS = 200
"""Steps (and waits) of a workflow shown at most."""
RECENT_KEYS = 20
MAX_NAME = 1024
"""The longest handler or key the form takes (an idempotency key has at most 512)."""


@router.get("/inbox")
async def inbox_page(
    request: Request,
    session: Viewer,
    handler: Annotated[str, Query(max_length=MAX_NAME)] = "",
    key: Annotated[str, Query(max_length=MAX_NAME)] = "",
    full: bool = False,
) -> Response:
    engine = console_of(request).engine
    if not handler or not key:
        async with engine.connect() as conn:
            recent = await lookup.recent_keys(conn, RECENT_KEYS)
        return render(
            request, "inbox.html", handler=handler, key=key, entry=None, asked=False, recent=recent
        )
    cap, cell = (FULL_CHARS, FULL_CELL_CHARS) if full else (PREVIEW_CHARS, CELL_CHARS)
    async with engine.connect() as conn:
        entry = await lookup.inbox_entry(conn, handler, key, cap)
        steps = await lookup.steps_of(conn, handler, key, MAX_STEPS, cell) if entry else []
        waits = await lookup.waits_of(conn, handler, key, MAX_STEPS, cell) if entry else []
    async with engine.begin() as conn:
        orphan = await owners.orphan(conn, handler, key) if entry else None
    return render(
        request,
        "inbox.html",
        status=HTTPStatus.OK if entry is not None else HTTPStatus.NOT_FOUND,
        handler=handler,
        key=key,
        entry=entry,
        asked=True,
        recent=[],
        steps=steps,
        waits=waits,
        orphan=orphan,
        resume=resume_command(handler, key),
        full=full,
        max_steps=MAX_STEPS,
    )
