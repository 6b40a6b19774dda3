"""The console's pages as HTML: Jinja2 templates shipped in ``templates/``, rendered with every
value escaped.

Invariant: autoescaping is on for every template, whatever its name, and an undefined name is an
error, so a value reaches a page only through the escaping of ``{{ }}``. No template marks a
value ``safe``; a page that needs markup builds it in the template from escaped parts.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from http import HTTPStatus
from typing import Any

import jinja2
from starlette.requests import Request
from starlette.responses import HTMLResponse

REFRESH_SECONDS = 5
"""Seconds between two refreshes of a live part of a page (the overview's)."""

environment = jinja2.Environment(
    loader=jinja2.PackageLoader("worker.console", "templates"),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)


def ago(seconds: float | None) -> str:
    """A duration for people: ``4 s``, ``12 min``, ``3 h``, ``2 d``; ``-`` for None."""
    if seconds is None:
        return "-"
    seconds = max(0.0, float(seconds))
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size * 2 or (unit == "min" and seconds >= 120):
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"


def when(moment: datetime | None) -> str:
    """A moment as UTC ISO 8601 to the second; ``-`` for None."""
    if moment is None:
        return "-"
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def number(value: float | int | None) -> str:
    """A count with thousands separators (a rate to one decimal); ``-`` for None."""
    if value is None:
        return "-"
    if isinstance(value, float) and not value.is_integer():
        return f"{value:,.1f}"
    return f"{int(value):,}"


_HIDDEN = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\xad\u034f\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891"
    "\u08e2\u115f\u1160\u17b4\u17b5\u180b-\u180f\u200b-\u200f\u2028-\u202e\u2060-\u206f"
    "\u3164\ufe00-\ufe0f\ufeff\uffa0\ufff0-\ufffb\U000110bd\U000110cd\U00013430-\U0001343f"
    "\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0000-\U000e0fff]"
)
"""Control characters (but tab and newline), every format character (bidirectional marks and
overrides, zero-width ones, Unicode tags) and the characters that render as nothing (fillers,
variation selectors)."""


def _escape(found: re.Match[str]) -> str:
    code = ord(found.group())
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def visible(value: str | None) -> str:
    """``value`` with each control, invisible or bidirectional formatting character written as
    an escape (``\\u202e``), so a stored value cannot hide text or reorder what a page shows
    around it (escaping for HTML is still the template's); ``""`` for None."""
    if value is None:
        return ""
    return _HIDDEN.sub(_escape, value)


environment.filters.update(ago=ago, when=when, number=number, visible=visible)


def render(
    request: Request, template: str, *, status: int = HTTPStatus.OK, **context: Any
) -> HTMLResponse:
    """``template`` rendered for ``request``: with the session's user and CSRF token (when
    logged in), the path, and ``context``."""
    session = getattr(request.state, "session", None)
    page = environment.get_template(template).render(
        request=request,
        path=request.url.path,
        user=None if session is None else session.user,
        csrf="" if session is None else session.csrf,
        nav=getattr(request.app.state, "nav", ()),
        refresh_seconds=REFRESH_SECONDS,
        **context,
    )
    return HTMLResponse(page, status_code=status)
