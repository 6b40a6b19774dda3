"""An operator action for the console's security tests to aim at: ``POST /test-probe`` takes
``guard.OperatorAction`` as every action page does, and does nothing but write its audit entry
(action ``probe``, the form's ``target``). So whether an action ran is whether its entry is
there. ``with_probe`` serves it beside the console's own pages, for one test."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from http import HTTPStatus

import pytest
from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from worker.console import app, audit
from worker.console.guard import OperatorAction
from worker.console.state import console_of

PATH = "/test-probe"
ACTION = "probe"

router = APIRouter()


@router.post(PATH)
async def probe(request: Request, action: OperatorAction) -> Response:
    target = action.form.one("target") or ""
    await audit.record(console_of(request), action.session.user, ACTION, target, 1, "done")
    return RedirectResponse("/audit", HTTPStatus.SEE_OTHER)


@contextlib.contextmanager
def with_probe(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Consoles created in the block serve ``POST /test-probe`` too."""
    with monkeypatch.context() as patch:
        patch.setattr(app, "ROUTERS", (*app.ROUTERS, router))
        yield
