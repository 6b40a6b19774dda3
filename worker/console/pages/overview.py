"""``/overview``: every worker and relay process with its state and rates, the work queue, the DLQ
and the outbox now (``/overview/live``, refreshed every ``REFRESH_SECONDS`` by the page's script),
and charts of the last hour (``/overview/charts``, every ``CHARTS_SECONDS``), drawn on the server
as inline SVG from the processes' samples (``worker.ops.overview``).

Invariant: a view of the overview costs the worker nothing it would notice, however many are
open: the numbers come from the samples the processes write anyway (index ranges of a small
table) and two passive declares; nothing counts the outbox or the inbox. Every value shown
passes the templates' escaping (a process's host, reason and the queues' names included).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aio_pika.abc import AbstractConnection
from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from worker.console.guard import Viewer
from worker.console.state import console_of
from worker.console.templating import render
from worker.ops import overview

router = APIRouter()

CHARTS_SECONDS = 30
"""Seconds between two refreshes of the charts (a sample comes every ``sample_interval``)."""

WINDOW = 3600.0
"""Seconds the charts span."""

POINTS = 120
"""Buckets of a chart (30 s each over the hour)."""

WIDTH = 600
HEIGHT = 100
"""A chart's drawing area, in the SVG's own units (stretched to the page's width)."""


@dataclass(frozen=True)
class Chart:
    """One chart: its ``title``, the ``top`` of its scale, the ``latest`` value, and its line
    as ``runs`` of SVG points (``x,y x,y ...``), broken where no sample fell."""

    title: str
    top: float
    latest: float | None
    runs: tuple[str, ...]
    bad: bool = False


def scale_top(values: Sequence[float | None]) -> float:
    """The top of a chart's scale: the largest value rounded up to 1, 2 or 5 times a power of
    ten (1 for an empty or all-zero series)."""
    largest = max((v for v in values if v is not None), default=0.0)
    if not largest > 0:
        return 1.0
    power = 10.0 ** math.floor(math.log10(largest))
    return next(m * power for m in (1, 2, 5, 10) if largest <= m * power)


def runs(values: Sequence[float | None], top: float) -> tuple[str, ...]:
    """The points of each unbroken run of ``values`` (None breaks one), spread over ``WIDTH``
    and scaled to ``top`` over ``HEIGHT`` (y grows downwards); a run of one value is drawn as a
    short dash."""
    if not values:
        return ()
    step = WIDTH / max(1, len(values) - 1)
    found: list[str] = []
    current: list[tuple[float, float]] = []
    for i, value in enumerate((*values, None)):
        if value is None:
            if len(current) == 1:
                x, y = current[0]
                current = [(max(0.0, x - step / 2), y), (min(float(WIDTH), x + step / 2), y)]
            if current:
                found.append(" ".join(f"{x:.1f},{y:.1f}" for x, y in current))
            current = []
            continue
        y = HEIGHT - min(max(value, 0.0), top) / top * HEIGHT
        current.append((i * step, y))
    return tuple(found)


def chart(title: str, values: Sequence[float | None], *, bad: bool = False) -> Chart:
    """``values`` (oldest first) as a ``Chart``."""
    top = scale_top(values)
    latest = next((v for v in reversed(values) if v is not None), None)
    return Chart(title, top, latest, runs(values, top), bad)


def charts(history: overview.History) -> list[Chart]:
    """The overview's four charts of ``history``."""
    return [
        chart("Processed per second", history.processed),
        chart("Failures per second (dead-lettered or retried)", history.failures, bad=True),
        chart("Work queue: ready messages", history.work_queue),
        chart("Outbox: rows waiting to be published", history.outbox_backlog),
    ]


@router.get("/overview")
async def overview_page(request: Request, session: Viewer) -> Response:
    live, history = await asyncio.gather(_live(request), _history(request))
    return render(request, "overview.html", **live, **history, charts_seconds=CHARTS_SECONDS)


@router.get("/overview/live")
async def overview_live(request: Request, session: Viewer) -> Response:
    """The live part of the overview alone, for the page's script to put in place."""
    return render(request, "overview_live.html", **await _live(request))


@router.get("/overview/charts")
async def overview_charts(request: Request, session: Viewer) -> Response:
    """The charts alone, for the page's script to put in place."""
    return render(request, "overview_charts.html", **await _history(request))


async def _live(request: Request) -> dict[str, Any]:
    console = console_of(request)
    settings = console.settings
    connection: AbstractConnection | None = None
    unreachable: str | None = None
    try:
        connection = await asyncio.wait_for(console.broker(), overview.READ_TIMEOUT)
    except Exception as exc:
        unreachable = overview.unread(exc)
    seen = await overview.overview(console.engine, connection, settings)
    if unreachable is not None:
        seen = dataclasses.replace(seen, errors={**seen.errors, "broker": unreachable})
    return {
        "seen": seen,
        "seen_within": overview.seen_within(settings.sample_interval),
    }


async def _history(request: Request) -> dict[str, Any]:
    console = console_of(request)
    try:
        history = await overview.history(
            console.engine,
            window=WINDOW,
            points=POINTS,
            interval=console.settings.sample_interval,
        )
    except Exception as exc:
        found: list[Chart] = []
        error: str | None = overview.unread(exc)
    else:
        found, error = charts(history), None
    return {
        "charts": found,
        "charts_error": error,
        "window": WINDOW,
        "width": WIDTH,
        "height": HEIGHT,
    }
