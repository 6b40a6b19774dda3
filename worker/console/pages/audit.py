"""``/audit``: the console's actions, newest first, a page of ``PAGE_SIZE`` at a time (keyset
pages by id: ``?before=<id>``)."""

from __future__ import annotations

from fastapi import APIRouter, Query
from starlette.requests import Request
from starlette.responses import Response

from worker.console.guard import MAX_ID, Viewer
from worker.console.state import console_of
from worker.console.templating import render
from worker.sql import audit

router = APIRouter()

PAGE_SIZE = 100


@router.get("/audit")
async def audit_page(
    request: Request,
    session: Viewer,
    before: int | None = Query(None, ge=1, le=MAX_ID),
) -> Response:
    async with console_of(request).engine.connect() as conn:
        entries = await audit.page(conn, before=before, limit=PAGE_SIZE)
    older = entries[-1].id if len(entries) == PAGE_SIZE else None
    return render(request, "audit.html", entries=entries, older=older)
