"""The console's pages, one module each, each an ``APIRouter``: ``ROUTERS`` lists them for the
application and ``NAV`` the pages the navigation bar links to, in order (the first is where ``/``
leads).

To add a page: a module here with ``router = APIRouter()`` whose routes declare
a ``guard.Viewer`` parameter (or a ``guard.OperatorAction`` for a POST that acts), a template in
``templates/`` that extends ``base.html``, and a line in ``ROUTERS`` (and ``NAV``).
"""

from __future__ import annotations

from fastapi import APIRouter

from worker.console.pages import audit, dead_letters, inbox, login, outbox, overview

ROUTERS: tuple[APIRouter, ...] = (
    login.router,
    overview.router,
    dead_letters.router,
    outbox.router,
    inbox.router,
    audit.router,
)
NAV: tuple[tuple[str, str], ...] = (
    ("Overview", "/overview"),
    ("Dead letters", "/dead-letters"),
    ("Outbox", "/outbox"),
    ("Inbox", "/inbox"),
    ("Audit", "/audit"),
)
"""(label, path) of each page in the navigation bar."""
