"""``/outbox``: unpublished events by state (scheduled, pending, backing off, parked), a row's
own page with its headers and body, and the operator's actions on them, each the code
``worker outbox`` runs (``worker.ops.admin``): retry (parked rows back into the outbox), hurry
(backing-off rows due now) and cancel (scheduled events never published; a waiting workflow's
timer refused).

Invariant: every read is bounded whatever the outbox's size: the counts stop at
``inspection.OUTBOX_COUNT_LIMIT`` per state, a list is a keyset page of ``PAGE_SIZE`` rows of one
index range (of one routing key: those among the next ``SCAN_ROWS`` rows of it), a row is read
by its primary key with its body, headers and error cut in the database
(``lookup.outbox_row``). An action is a preview that changes nothing (the action's
own transaction, rolled back: exactly what it would do at that instant), then a confirmation
carrying the exact selection previewed (row ids, message ids, or one routing key) and the
session's CSRF token, which acts once and is written to the audit, then a result page (the
audit's entry) that a reload does not repeat.
"""

from __future__ import annotations

import codecs
import uuid
from collections.abc import Sequence
from datetime import datetime
from http import HTTPStatus
from typing import Annotated, Any, NoReturn
from urllib.parse import urlencode

from fastapi import APIRouter, HTTPException, Path, Query
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from worker.console import audit
from worker.console.guard import MAX_ID, Action, OperatorAction, Viewer
from worker.console.state import Console, console_of
from worker.console.templating import render
from worker.logs import describe_error
from worker.ops import admin
from worker.sql import audit as audit_table
from worker.sql import inspection, lookup

router = APIRouter()

PAGE_SIZE = 200
"""Rows a list shows at a time (then a link to the next page)."""
SCAN_ROWS = 10_000
"""Rows of a state a page of one routing key reads at most to find its rows (then a link reads
the next as many): no index holds the routing key, so a rare one is sought a window at a time,
never through the whole outbox."""
PREVIEW_BYTES = 4096
"""Bytes of a body (characters of headers or an error) a row's page shows at first."""
FULL_BYTES = 1 << 20
"""Bytes (characters) a row's page shows at most when asked for all of a value."""
ERROR_CHARS = 200
"""Characters of a last error a list shows (its row's page shows more)."""
SHOWN_IDS = 100
"""Ids a preview, a result or an audit entry names at most (the counts are whole)."""
MAX_ROUTING_KEY = 255
"""The longest routing key AMQP carries (a short string)."""

ACTIONS = {"parked": "retry", "backing-off": "hurry", "scheduled": "cancel"}
"""The action an operator may take on the rows of each state."""
TABLES = {
    "scheduled": "scheduled",
    "pending": "outbox",
    "backing-off": "outbox",
    "parked": "parked",
}
"""Where a row of each state is (``lookup.OUTBOX_TABLES``)."""
FIRST_SHOWN = ("parked", "backing-off", "pending", "scheduled")
"""The state ``/outbox`` shows when none is asked for: the first of these with rows."""


def _url(path: str, **query: Any) -> str:
    """``path`` with the query's parameters that are not None, encoded."""
    given = {name: value for name, value in query.items() if value is not None}
    return f"{path}?{urlencode(given)}" if given else path


@router.get("/outbox")
async def outbox_page(
    request: Request,
    session: Viewer,
    state: str | None = None,
    routing_key: Annotated[str | None, Query(max_length=MAX_ROUTING_KEY)] = None,
    after_at: datetime | None = None,
    after_id: Annotated[int | None, Query(ge=0, le=MAX_ID)] = None,
) -> Response:
    if state is not None and state not in inspection.OUTBOX_STATES:
        raise HTTPException(HTTPStatus.NOT_FOUND, "no such state of the outbox")
    routing_key = routing_key or None
    console = console_of(request)
    async with console.engine.connect() as conn:
        counts = await inspection.outbox_counts(conn)
    if state is None:
        state = next((s for s in FIRST_SHOWN if counts.counts[s]), "pending")
    after = None if after_id is None else inspection.OutboxCursor(after_at, after_id)
    scan = SCAN_ROWS if routing_key is not None else None
    entries = await admin.read_outbox(
        console.engine,
        [state],
        routing_key=routing_key,
        limit=PAGE_SIZE + 1,
        after=after,
        scan=scan,
    )
    more = len(entries) > PAGE_SIZE
    entries = entries[:PAGE_SIZE]
    cursor = inspection.OutboxCursor.of(entries[-1]) if more else None
    window_end = None
    if scan is not None and not more:
        async with console.engine.connect() as conn:
            window_end = await inspection.scan_end(conn, state, scan, after=after)
        cursor = window_end
    following = None
    if cursor is not None:
        following = _url(
            "/outbox",
            state=state,
            routing_key=routing_key,
            after_at=None if cursor.at is None else cursor.at.isoformat(),
            after_id=cursor.id,
        )
    return render(
        request,
        "outbox.html",
        state=state,
        routing_key=routing_key,
        counts=counts,
        tabs=[
            (name, _url("/outbox", state=name, routing_key=routing_key))
            for name in inspection.OUTBOX_STATES
        ],
        entries=entries,
        paged=after is not None,
        first_page=_url("/outbox", state=state, routing_key=routing_key),
        following=following,
        action=ACTIONS.get(state),
        page_size=PAGE_SIZE,
        error_chars=ERROR_CHARS,
        window=scan if window_end is not None else None,
    )


def _decoded(body: bytes, complete: bool) -> str:
    """A body as text: UTF-8, each byte that is not written as ``\\xNN``; a body cut short
    loses the incomplete character at its end rather than show it as bytes."""
    decoder = codecs.getincrementaldecoder("utf-8")("backslashreplace")
    return decoder.decode(body, final=complete)


@router.get("/outbox/row/{state}/{row_id}")
async def row_page(
    request: Request,
    session: Viewer,
    state: str,
    row_id: Annotated[int, Path(ge=0, le=MAX_ID)],
    full: bool = False,
) -> Response:
    if state not in TABLES:
        raise HTTPException(HTTPStatus.NOT_FOUND, "no such state of the outbox")
    cap = FULL_BYTES if full else PREVIEW_BYTES
    async with console_of(request).engine.connect() as conn:
        row = await lookup.outbox_row(conn, TABLES[state], row_id, cap)
    if row is None:
        return render(
            request,
            "outbox_row.html",
            status=HTTPStatus.NOT_FOUND,
            state=state,
            row_id=row_id,
            row=None,
        )
    return render(
        request,
        "outbox_row.html",
        state=row.state,
        row_id=row_id,
        row=row,
        body=_decoded(row.body, len(row.body) == row.body_size),
        cap=cap,
        full=full,
        see_all=_url(f"/outbox/row/{row.state}/{row.id}", full="1"),
        action=None if row.timer is not None else ACTIONS.get(row.state),
    )


# --- retry and hurry ------------------------------------------------------------------------


def _ids(action: Action) -> list[int]:
    """The row ids the form carries (each once, in order); 400 for one that is no id."""
    try:
        ids = [int(raw) for raw in action.form.all("id")]
    except ValueError:
        raise HTTPException(HTTPStatus.BAD_REQUEST, "a selected id is not a number") from None
    if any(not 0 <= i <= MAX_ID for i in ids):
        raise HTTPException(HTTPStatus.BAD_REQUEST, "a selected id is not a row's id")
    return list(dict.fromkeys(ids))


def _routing_key(action: Action) -> str | None:
    """The routing key the form names, if any; 400 past ``MAX_ROUTING_KEY``."""
    routing_key = action.form.one("routing_key") or None
    if routing_key is not None and len(routing_key) > MAX_ROUTING_KEY:
        raise HTTPException(HTTPStatus.BAD_REQUEST, "the routing key is too long")
    return routing_key


def _selection(action: Action) -> tuple[list[int] | None, str | None]:
    """(ids, None) for the ticked rows, or (None, routing key) for every row of one; 400 for
    neither (an action never runs on the whole outbox from the console)."""
    ids = _ids(action)
    if ids:
        return ids, None
    routing_key = _routing_key(action)
    if routing_key is None:
        raise HTTPException(HTTPStatus.BAD_REQUEST, "tick rows, or name a routing key, first")
    return None, routing_key


def _target(state: str, ids: Sequence[object] | None, routing_key: str | None) -> str:
    """What an action acted on, as its user chose it."""
    if ids is None:
        return f"{state} rows of routing key {routing_key}"
    return f"{state} ids {', '.join(map(str, ids))}"


def _named(values: Sequence[Any]) -> dict[str, Any]:
    """The first ``SHOWN_IDS`` of ``values`` (as text) and how many there are."""
    return {"first": [str(value) for value in values[:SHOWN_IDS]], "total": len(values)}


async def _failed(
    console: Console, action: Action, verb: str, target: str, exc: Exception
) -> NoReturn:
    """Audit an action that failed (its one transaction rolled back: nothing changed) and
    answer 503."""
    await audit.record(
        console, action.session.user, verb, target, 0, f"failed: {describe_error(exc)}"
    )
    raise HTTPException(
        HTTPStatus.SERVICE_UNAVAILABLE, f"not done, nothing changed: {describe_error(exc)}"
    ) from exc


async def _retry(
    request: Request, action: Action, verb: str, state: str, *, dry_run: bool
) -> tuple[list[int] | None, str | None, admin.Retried]:
    """The form's selection and what ``admin.retry_outbox_rows`` did to it in ``state`` (or
    would do, with ``dry_run``)."""
    console = console_of(request)
    ids, routing_key = _selection(action)
    try:
        retried = await admin.retry_outbox_rows(
            console.engine,
            ids,
            routing_key=routing_key,
            states=(state,),
            notify=console.settings.outbox_notify and not dry_run,
            dry_run=dry_run,
        )
    except Exception as exc:
        await _failed(console, action, f"outbox.{verb}", _target(state, ids, routing_key), exc)
    return ids, routing_key, retried


def _acted(retried: admin.Retried) -> list[int]:
    """The ids (before the move, for a parked row) of the rows a retry or a hurry acted on."""
    return [row.id for row in retried.hurried] + [row.parked_id for row in retried.moved]


async def _preview_retry(request: Request, action: Action, verb: str, state: str) -> Response:
    ids, routing_key, would = await _retry(request, action, verb, state, dry_run=True)
    acted = _acted(would)
    keys = [(row.message_id, row.routing_key) for row in would.hurried]
    keys += [(row.message_id, row.routing_key) for row in would.moved]
    return render(
        request,
        "outbox_preview.html",
        verb=verb,
        state=state,
        routing_key=routing_key,
        rows=[(row_id, *key) for row_id, key in zip(acted, keys, strict=True)][:PAGE_SIZE],
        count=len(acted),
        confirm_ids=acted if ids is not None else [],
        due=would.due,
        unknown=would.unknown,
        cancel=None,
        back=_url("/outbox", state=state, routing_key=routing_key),
        page_size=PAGE_SIZE,
    )


async def _do_retry(request: Request, action: Action, verb: str, state: str) -> Response:
    ids, routing_key, done = await _retry(request, action, verb, state, dry_run=False)
    acted = _acted(done)
    detail = {
        "state": state,
        "routing_key": routing_key,
        "done": _named(acted),
        "new_ids": _named([row.id for row in done.moved]),
        "due": _named(done.due),
        "unknown": _named(done.unknown),
    }
    entry = await audit.record(
        console_of(request),
        action.session.user,
        f"outbox.{verb}",
        _target(state, ids, routing_key),
        len(acted),
        "done",
        detail,
    )
    return RedirectResponse(f"/outbox/done/{entry}", HTTPStatus.SEE_OTHER)


@router.post("/outbox/retry/preview")
async def retry_preview(request: Request, action: OperatorAction) -> Response:
    return await _preview_retry(request, action, "retry", "parked")


@router.post("/outbox/retry")
async def retry(request: Request, action: OperatorAction) -> Response:
    return await _do_retry(request, action, "retry", "parked")


@router.post("/outbox/hurry/preview")
async def hurry_preview(request: Request, action: OperatorAction) -> Response:
    return await _preview_retry(request, action, "hurry", "backing-off")


@router.post("/outbox/hurry")
async def hurry(request: Request, action: OperatorAction) -> Response:
    return await _do_retry(request, action, "hurry", "backing-off")


# --- cancel ---------------------------------------------------------------------------------


def _message_ids(action: Action) -> list[uuid.UUID]:
    """The message ids the form carries (each once, in order); 400 for none, or one that is
    no UUID."""
    try:
        asked = [uuid.UUID(raw) for raw in action.form.all("message_id")]
    except ValueError:
        raise HTTPException(HTTPStatus.BAD_REQUEST, "a selected message id is no UUID") from None
    if not asked:
        raise HTTPException(HTTPStatus.BAD_REQUEST, "tick the events to cancel first")
    return list(dict.fromkeys(asked))


async def _cancel(
    request: Request, action: Action, *, dry_run: bool
) -> tuple[list[uuid.UUID], admin.Cancelled]:
    """The form's message ids and what ``admin.cancel_outbox_events`` did to them (or would
    do, with ``dry_run``)."""
    console = console_of(request)
    asked = _message_ids(action)
    try:
        return asked, await admin.cancel_outbox_events(console.engine, asked, dry_run=dry_run)
    except Exception as exc:
        await _failed(console, action, "outbox.cancel", _target("message", asked, None), exc)


@router.post("/outbox/cancel/preview")
async def cancel_preview(request: Request, action: OperatorAction) -> Response:
    _, would = await _cancel(request, action, dry_run=True)
    return render(
        request,
        "outbox_preview.html",
        verb="cancel",
        state="scheduled",
        routing_key=None,
        rows=[],
        count=len(would.cancelled),
        confirm_ids=would.cancelled,
        due=[],
        unknown=would.unknown,
        cancel=would,
        back=_url("/outbox", state="scheduled"),
        page_size=PAGE_SIZE,
    )


@router.post("/outbox/cancel")
async def cancel(request: Request, action: OperatorAction) -> Response:
    asked, done = await _cancel(request, action, dry_run=False)
    detail = {
        "done": _named(done.cancelled),
        "timers": _named(done.timers),
        "parked": _named(done.parked),
        "unknown": _named(done.unknown),
    }
    entry = await audit.record(
        console_of(request),
        action.session.user,
        "outbox.cancel",
        _target("message", asked, None),
        len(done.cancelled),
        "done",
        detail,
    )
    return RedirectResponse(f"/outbox/done/{entry}", HTTPStatus.SEE_OTHER)


# --- results --------------------------------------------------------------------------------

VERBS = ("outbox.retry", "outbox.hurry", "outbox.cancel")


@router.get("/outbox/done/{entry_id}")
async def done_page(
    request: Request, session: Viewer, entry_id: Annotated[int, Path(ge=1, lt=MAX_ID)]
) -> Response:
    async with console_of(request).engine.connect() as conn:
        found = await audit_table.page(conn, before=entry_id + 1, limit=1)
    if not found or found[0].id != entry_id or found[0].action not in VERBS:
        raise HTTPException(HTTPStatus.NOT_FOUND, "no such action on the outbox")
    entry = found[0]
    return render(request, "outbox_done.html", entry=entry, verb=entry.action.split(".")[1])
