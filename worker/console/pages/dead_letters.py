"""``/dead-letters``: the dead-letter queue grouped by reason and handler, a group's (or a
filter's) messages, one message in full, and replay or purge of a group, a filter or the ticked
messages, each shown first as a preview (the real dry run) and done only when confirmed.

Invariants: every read and action goes through ``worker.ops.dlq``, the code ``worker dlq`` runs,
with its rules (a copy is the worker's only if its record says so; a replay refuses, unless
forced, an unverified copy and one parked longer ago than ``inbox_retention``; a purge never
takes an unverified copy for what its headers claim). A view or an action takes at most
``dlq.SCAN_LIMIT`` messages from the queue and says so when it held more; the console runs one
of them at a time (two sweeps at once would each hide from the other the messages it holds
unacked). An action confirmed after a preview leaves what was parked since the preview; its
result page is its audit entry. Every value that came with a message reaches the page through
``{{ … | visible }}``, so neither markup nor control, invisible or bidirectional characters take
effect; a body's bytes that are not UTF-8 are shown as ``\\xNN``.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import re
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http import HTTPStatus
from typing import Annotated, Any
from urllib.parse import quote, urlencode

from aio_pika.abc import AbstractRobustConnection
from aio_pika.exceptions import ChannelNotFoundEntity
from fastapi import APIRouter, HTTPException, Path, Query
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from worker import logs
from worker.console import audit
from worker.console.guard import MAX_ID, Action, Form, OperatorAction, Viewer
from worker.console.state import Console, console_of
from worker.console.templating import render
from worker.ops import dlq
from worker.sql import audit as audit_table

router = APIRouter()

PAGE_SIZE = 100
"""Messages a page of ``/dead-letters/messages`` lists."""
PREVIEW_ROWS = 200
"""Messages a preview lists one by one (it counts them all)."""
BODY_BYTES = 4096
"""Bytes of a body the message page shows (``?full=1``: ``FULL_BODY_BYTES``)."""
FULL_BODY_BYTES = 1024 * 1024
HEADER_CHARS = 1024
"""Characters of a header's value the message page shows (``?full=1``: all)."""
MAX_FILTER = 512
"""Characters a filter (key, handler) may have: a key has at most 512."""
MAX_IDS = 1000
"""Messages a selection by id may name."""
ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|sha256:[0-9a-f]{32}")
"""What a parked message's id looks like (``dlq.Parked.id``)."""
VERBS = {"replay": "replayed", "purge": "purged"}
"""The actions, and what their result says they did (audited as ``dlq <action>``)."""
INTERRUPTED = "interrupted: the console stopped before the action ended"
"""Why an action cut short by the console's stop failed, in its audit entry."""


MAX_WAITING_VIEWS = 4
"""Views of the DLQ (pages asked for by a GET) that wait at most while another sweep runs; one
more is answered 503 at once. Each view is a sweep of up to ``dlq.SCAN_LIMIT`` messages, seconds
long, so without this bound anyone logged in could queue views until every request the console
serves at once (``ingress_max_requests``) waited for the DLQ, and no other page answered. An
operator's preview or confirmation is never refused for it: it waits behind these few."""


@dataclass
class Sweeps:
    """The sweeps of one console's DLQ: the lock that lets one run at a time, and how many views
    wait for it."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    waiting_views: int = 0


_sweeps: weakref.WeakKeyDictionary[Console, Sweeps] = weakref.WeakKeyDictionary()


def sweeps_of(console: Console) -> Sweeps:
    """``console``'s ``Sweeps``, made on first use."""
    sweeps = _sweeps.get(console)
    if sweeps is None:
        sweeps = _sweeps[console] = Sweeps()
    return sweeps


@contextlib.asynccontextmanager
async def _turn(console: Console, *, view: bool) -> AsyncIterator[None]:
    """Hold the sweep lock of ``console``'s DLQ; a view is refused (503) rather than wait behind
    ``MAX_WAITING_VIEWS`` others."""
    sweeps = sweeps_of(console)
    if view and sweeps.waiting_views >= MAX_WAITING_VIEWS:
        raise HTTPException(
            HTTPStatus.SERVICE_UNAVAILABLE,
            f"the dead-letter queue is being read, and {MAX_WAITING_VIEWS} more views of it "
            "wait their turn: ask again in a few seconds",
        )
    waiting = 1 if view else 0
    sweeps.waiting_views += waiting
    try:
        await sweeps.lock.acquire()
    finally:
        sweeps.waiting_views -= waiting
    try:
        yield
    finally:
        sweeps.lock.release()


@contextlib.asynccontextmanager
async def _sweeping(
    console: Console, *, view: bool = False
) -> AsyncIterator[AbstractRobustConnection]:
    """The broker connection, for one sweep of the DLQ at a time (see the module's invariant
    and ``MAX_WAITING_VIEWS``); a broker that cannot be reached is a 503, a DLQ that does not
    exist a 404."""
    async with _turn(console, view=view):
        try:
            connection = await console.broker()
        except Exception as exc:
            raise HTTPException(
                HTTPStatus.SERVICE_UNAVAILABLE,
                f"the broker cannot be reached: {logs.describe_error(exc)}",
            ) from exc
        try:
            yield connection
        except ChannelNotFoundEntity:
            raise HTTPException(
                HTTPStatus.NOT_FOUND,
                f"the dead-letter queue {console.settings.dead_letter_queue} does not exist",
            ) from None


def _filter(value: str | None, name: str) -> str | None:
    """A filter's value (None when blank); a 400 when longer than ``MAX_FILTER``."""
    if value is None or value == "":
        return None
    if len(value) > MAX_FILTER:
        raise HTTPException(HTTPStatus.BAD_REQUEST, f"the {name} filter is too long")
    return value


def selection_of(key: str | None, reason: str | None, handler: str | None) -> dlq.Selection:
    """The selection the filters make, as ``worker dlq``'s flags do; an unknown reason is a
    400 that lists the known ones."""
    reason = _filter(reason, "reason")
    if reason is not None and reason not in dlq.REASONS:
        raise HTTPException(
            HTTPStatus.BAD_REQUEST,
            f"unknown reason {reason!r}; the reasons are: {', '.join(dlq.REASONS)}",
        )
    return dlq.Selection(
        key=_filter(key, "key"), reason=reason, handler=_filter(handler, "handler")
    )


def query(**params: str | int | None) -> str:
    """A query string of the ``params`` that are set (``?a=1&b=2``), or ``""``."""
    kept = {name: value for name, value in params.items() if value is not None}
    return "?" + urlencode(kept) if kept else ""


def _messages_url(**params: str | int | None) -> str:
    return "/dead-letters/messages" + query(**params)


def message_url(copy_id: str) -> str:
    return "/dead-letters/message/" + quote(copy_id, safe="")


def _filters_of(selection: dlq.Selection) -> dict[str, str | None]:
    return {"key": selection.key, "reason": selection.reason, "handler": selection.handler}


def _context(request: Request, session_may_act: bool) -> dict[str, Any]:
    """What every dead-letter page's template is given."""
    settings = console_of(request).settings
    return {
        "queue": settings.dead_letter_queue,
        "work_queue": settings.queue,
        "scan_limit": dlq.SCAN_LIMIT,
        "may_act": session_may_act,
        "message_url": message_url,
        "reasons": dlq.REASONS,
        "no_handler": dlq.NO_HANDLER,
    }


@router.get("/dead-letters")
async def groups_page(
    request: Request,
    session: Viewer,
    key: str | None = Query(None),
    reason: str | None = Query(None),
    handler: str | None = Query(None),
) -> Response:
    console = console_of(request)
    selection = selection_of(key, reason, handler)
    groups = None
    async with _sweeping(console, view=True) as connection:
        depth = await dlq.depth(connection, console.settings)
        if depth is not None:
            groups = await dlq.grouped(
                connection, console.engine, console.settings, selection=selection
            )
    rows = [
        (group, _messages_url(key=selection.key, reason=group.reason, handler=group.handler))
        for group in (groups.groups if groups else [])
    ]
    return render(
        request,
        "dead_letters.html",
        depth=depth,
        groups=groups,
        rows=rows,
        selection=selection,
        filters=_filters_of(selection),
        all_messages=_messages_url(**_filters_of(selection)),
        **_context(request, session.user.may_act),
    )


@router.get("/dead-letters/messages")
async def messages_page(
    request: Request,
    session: Viewer,
    key: str | None = Query(None),
    reason: str | None = Query(None),
    handler: str | None = Query(None),
    start: int = Query(0, ge=0, le=dlq.SCAN_LIMIT),
) -> Response:
    console = console_of(request)
    selection = selection_of(key, reason, handler)
    scan = dlq.Scan(dlq.SCAN_LIMIT)
    page: list[dlq.Parked] = []
    matched = 0
    async with _sweeping(console, view=True) as connection:
        depth = await dlq.depth(connection, console.settings)
        if depth is not None:
            found = dlq.browse(
                connection,
                console.engine,
                console.settings,
                selection=selection,
                limit=start + PAGE_SIZE + 1,
                scan=scan,
            )
            async with contextlib.aclosing(found) as outcomes:
                async for outcome in outcomes:
                    if start <= matched < start + PAGE_SIZE:
                        page.append(outcome.parked)
                    matched += 1
    filters = _filters_of(selection)
    newer = min(start + PAGE_SIZE, dlq.SCAN_LIMIT)
    return render(
        request,
        "dead_letters_messages.html",
        depth=depth,
        page=page,
        start=start,
        scan=scan,
        selection=selection,
        filters=filters,
        later=_messages_url(**filters, start=newer) if matched > start + PAGE_SIZE else None,
        earlier=_messages_url(**filters, start=max(0, start - PAGE_SIZE) or None)
        if start
        else None,
        **_context(request, session.user.may_act),
    )


def body_text(body: bytes, *, cut: bool) -> str:
    """``body`` (its first bytes when ``cut``) as text: decoded as UTF-8, each byte that is not
    UTF-8 as ``\\xNN``, a character cut short at the end of a cut body left out (the template
    shows the text ``visible``)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="backslashreplace")
    return decoder.decode(body, final=not cut)


def is_utf8(body: bytes) -> bool:
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def shown_value(value: object, *, full: bool) -> tuple[str, bool]:
    """A header's value as text (``dlq.header_text``), cut to ``HEADER_CHARS`` unless ``full``;
    and whether it was cut."""
    text = dlq.header_text(value)
    if full or len(text) <= HEADER_CHARS:
        return text, False
    return text[:HEADER_CHARS], True


@router.get("/dead-letters/message/{copy_id}")
async def message_page(
    request: Request, session: Viewer, copy_id: str, full: bool = Query(False)
) -> Response:
    console = console_of(request)
    if not ID.fullmatch(copy_id):
        raise HTTPException(HTTPStatus.NOT_FOUND, "no parked message has such an id")
    async with _sweeping(console, view=True) as connection:
        found = await dlq.find(
            connection,
            console.engine,
            console.settings,
            copy_id,
            limit=1,
            scan=dlq.Scan(dlq.SCAN_LIMIT),
        )
    if not found:
        raise HTTPException(
            HTTPStatus.NOT_FOUND,
            f"no message with id {copy_id} among the first {dlq.SCAN_LIMIT:,} of "
            f"{console.settings.dead_letter_queue}",
        )
    [shown] = found
    shown_bytes = FULL_BODY_BYTES if full else BODY_BYTES
    body = shown.body[:shown_bytes]
    cut_headers = False
    headers = []
    for name, value in shown.headers.items():
        text, cut = shown_value(value, full=full)
        cut_headers = cut_headers or cut
        headers.append((name, text, cut))
    properties = [
        (name, dlq.header_text(value))
        for name, value in shown.properties.items()
        if value is not None
    ]
    return render(
        request,
        "dead_letters_message.html",
        parked=shown.parked,
        properties=properties,
        headers=headers,
        body=body_text(body, cut=len(body) < len(shown.body)),
        body_bytes=len(shown.body),
        body_shown=len(body),
        utf8=is_utf8(shown.body),
        full=full,
        cut_headers=cut_headers,
        full_body_bytes=FULL_BODY_BYTES,
        **_context(request, session.user.may_act),
    )


@dataclass(frozen=True)
class Chosen:
    """What a preview or confirm form asks for: the action (``replay``, ``purge``), the
    selection (``scope`` ``ids``: the ticked messages; ``filter``: a group's or the filters'),
    and whether a replay is forced."""

    verb: str
    scope: str
    selection: dlq.Selection
    force: bool

    @property
    def target(self) -> str:
        """The selection as the user chose it, for the audit."""
        return self.selection.describe() + (" (forced)" if self.force else "")

    def fields(self) -> list[tuple[str, str]]:
        """The form fields that ask for this again (the confirm form's)."""
        found = [("action", self.verb), ("scope", self.scope)]
        if self.scope == "ids":
            found += [("id", copy_id) for copy_id in sorted(self.selection.ids or ())]
        else:
            found += [(name, value) for name, value in _filters_of(self.selection).items() if value]
        if self.force:
            found.append(("force", "1"))
        return found


def chosen_of(form: Form) -> Chosen:
    """The action a form asks for; a 400 for anything else."""
    verb = form.one("action")
    if verb not in VERBS:
        raise HTTPException(HTTPStatus.BAD_REQUEST, "no such action: replay or purge")
    scope = form.one("scope")
    if scope == "ids":
        ids = form.all("id")
        if not ids:
            raise HTTPException(HTTPStatus.BAD_REQUEST, "tick at least one message")
        if len(ids) > MAX_IDS or not all(ID.fullmatch(copy_id) for copy_id in ids):
            raise HTTPException(
                HTTPStatus.BAD_REQUEST, f"a selection names at most {MAX_IDS} messages by id"
            )
        selection = dlq.Selection(ids=frozenset(ids))
    elif scope == "filter":
        selection = selection_of(form.one("key"), form.one("reason"), form.one("handler"))
    else:
        raise HTTPException(HTTPStatus.BAD_REQUEST, "no such selection: ids or filter")
    return Chosen(verb, scope, selection, force=verb == "replay" and form.one("force") == "1")


def _sweep(
    console: Console,
    connection: AbstractRobustConnection,
    chosen: Chosen,
    scan: dlq.Scan,
    *,
    dry_run: bool,
    parked_before: datetime | None = None,
) -> AsyncGenerator[dlq.Outcome, None]:
    """The CLI's ``replaying`` or ``purging`` of ``chosen``, within ``scan``."""
    if chosen.verb == "replay":
        return dlq.replaying(
            connection,
            console.engine,
            console.settings,
            selection=chosen.selection,
            force=chosen.force,
            dry_run=dry_run,
            parked_before=parked_before,
            scan=scan,
        )
    return dlq.purging(
        connection,
        console.engine,
        console.settings,
        selection=chosen.selection,
        dry_run=dry_run,
        parked_before=parked_before,
        scan=scan,
    )


def _by_group(tally: dlq.Tally) -> list[tuple[str, str, int]]:
    return [(reason, handler, count) for (reason, handler), count in tally.done.most_common()]


@router.post("/dead-letters/preview")
async def preview(request: Request, action: OperatorAction) -> Response:
    console = console_of(request)
    chosen = chosen_of(action.form)
    made = datetime.now(UTC)
    scan = dlq.Scan(dlq.SCAN_LIMIT)
    listed: list[dlq.Outcome] = []

    def keep(outcome: dlq.Outcome) -> None:
        if len(listed) < PREVIEW_ROWS:
            listed.append(outcome)

    async with _sweeping(console) as connection:
        tally = await dlq.Tally().carry_out(
            _sweep(console, connection, chosen, scan, dry_run=True), keep
        )
    forcing = chosen.verb == "replay" and not chosen.force and tally.refused_count > 0
    return render(
        request,
        "dead_letters_preview.html",
        chosen=chosen,
        tally=tally,
        done=_by_group(tally),
        refused=tally.refused.most_common(),
        listed=listed,
        scan=scan,
        made=made.isoformat(),
        fields=chosen.fields(),
        force_fields=[*chosen.fields(), ("force", "1")] if forcing else None,
        retention=console.settings.inbox_retention,
        **_context(request, action.session.user.may_act),
    )


def _moment(value: str | None) -> datetime:
    """The preview's time a confirm form carries; a 400 when there is none that is one."""
    try:
        moment = datetime.fromisoformat(value or "")
    except ValueError:
        moment = None
    if moment is None or moment.tzinfo is None:
        raise HTTPException(HTTPStatus.BAD_REQUEST, "confirm a preview: its time is missing")
    return moment


def _detail(chosen: Chosen, tally: dlq.Tally, scan: dlq.Scan) -> Mapping[str, Any]:
    """The audit entry's detail, which the result page shows: what was done by reason and
    handler, what was refused and why, whether forced, how much of the queue was read (and the
    ids, for a selection of ids)."""
    detail: dict[str, Any] = {
        "refused": tally.refused_count,
        "done_by": [list(group) for group in _by_group(tally)],
        "refused_by": [[why, count] for why, count in tally.refused.most_common()],
        "force": chosen.force,
        "scanned": scan.taken,
        "more": scan.more,
    }
    if chosen.selection.ids is not None:
        detail["ids"] = sorted(chosen.selection.ids)
    return detail


@router.post("/dead-letters/confirm")
async def confirm(request: Request, action: OperatorAction) -> Response:
    async with console_of(request).acting():
        return await _confirmed(request, action)


async def _confirmed(request: Request, action: Action) -> Response:
    """Carry out the confirmed action, and write its audit entry however it ends (a stop of
    the console that cancels it mid-way included: ``confirm`` makes the stop wait for it)."""
    console = console_of(request)
    chosen = chosen_of(action.form)
    parked_before = _moment(action.form.one("before"))
    user = action.session.user
    name = f"dlq {chosen.verb}"
    scan = dlq.Scan(dlq.SCAN_LIMIT)
    tally = dlq.Tally()
    try:
        async with _sweeping(console) as connection:
            await tally.carry_out(
                _sweep(
                    console, connection, chosen, scan, dry_run=False, parked_before=parked_before
                )
            )
    except asyncio.CancelledError:
        await asyncio.shield(
            audit.record(
                console,
                user,
                name,
                chosen.target,
                tally.done_count,
                f"failed: {INTERRUPTED}",
                _detail(chosen, tally, scan),
            )
        )
        raise
    except Exception as exc:
        why = exc.detail if isinstance(exc, HTTPException) else logs.describe_error(exc)
        await audit.record(
            console,
            user,
            name,
            chosen.target,
            tally.done_count,
            f"failed: {why}",
            _detail(chosen, tally, scan),
        )
        raise HTTPException(
            HTTPStatus.SERVICE_UNAVAILABLE,
            f"the {chosen.verb} stopped ({why}) after {tally.done_count} message(s): "
            "the audit has the entry",
        ) from exc
    entry = await audit.record(
        console, user, name, chosen.target, tally.done_count, "done", _detail(chosen, tally, scan)
    )
    return RedirectResponse(f"/dead-letters/done/{entry}", HTTPStatus.SEE_OTHER)


@router.get("/dead-letters/done/{entry_id}")
async def done_page(
    request: Request, session: Viewer, entry_id: Annotated[int, Path(ge=1, lt=MAX_ID)]
) -> Response:
    """A replay's or a purge's result: its audit entry."""
    async with console_of(request).engine.connect() as conn:
        found = await audit_table.page(conn, before=entry_id + 1, limit=1)
    actions = {f"dlq {verb}": verb for verb in VERBS}
    if not found or found[0].id != entry_id or found[0].action not in actions:
        raise HTTPException(HTTPStatus.NOT_FOUND, "no such action on the dead letters")
    entry = found[0]
    return render(
        request,
        "dead_letters_done.html",
        entry=entry,
        did=VERBS[actions[entry.action]],
        **_context(request, session.user.may_act),
    )
