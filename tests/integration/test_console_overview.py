"""The console's overview against the real services, through HTTP: a running worker shows with
its state, the queues and the outbox change as messages flow (the live part, refreshed without
reloading the page), the charts draw the hour's samples as inline SVG, whatever a sample holds is
shown inert, and nothing is shown without a session."""

from __future__ import annotations

import re
from dataclasses import replace

import httpx
from aio_pika.abc import AbstractRobustConnection
from markupsafe import escape
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from examples.payments import router as payments
from tests.helpers import wait_until
from tests.integration.console_support import VIEWER_TOKEN, logged_in, running_console
from tests.integration.support import add_outbox_row, publish, running_worker, settled
from tests.integration.test_samples import a_sample, sampling, until_sampled
from worker.settings import Settings
from worker.sql import samples
from worker.sql.samples import Gauge


def card(page: str, name: str) -> str:
    """The value shown on the overview's card ``name`` (``dead-letters``, ``outbox-pending``)."""
    found = re.search(rf'id="{name}">.*?<div class="value[^"]*">([^<]*)</div>', page, re.DOTALL)
    assert found is not None, f"no card {name} in:\n{page}"
    return found.group(1).strip()


async def test_the_overview_shows_a_running_worker_and_changes_as_messages_flow(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given a running worker and an outbox row waiting, and the console
    settings = sampling(settings, relay=False)
    await add_outbox_row(engine, settings, age=30.0)
    async with (
        running_worker(settings, payments) as running,
        running_console(settings) as console,
        logged_in(console, VIEWER_TOKEN) as viewer,
    ):
        await until_sampled(engine, "state = 'consuming' AND gauges ->> 'outbox_backlog' = '1'")

        # When a read-only user opens the overview
        page = await viewer.client.get("/overview")

        # Then it shows the worker consuming, the queues and the outbox, and refreshes itself
        assert page.status_code == 200, page.text
        assert 'data-refresh="/overview/live"' in page.text
        assert 'data-refresh="/overview/charts"' in page.text
        assert '<td class="state-consuming">consuming</td>' in page.text
        assert escape(settings.queue) in page.text
        assert card(page.text, "dead-letters") == "0"
        assert card(page.text, "outbox-pending") == "1"
        assert page.text.count("<svg") == 4

        # When a message is dead-lettered
        channel = await amqp.channel(publisher_confirms=True)
        await publish(channel, settings, {"payment_id": "bad"}, key="ov-bad")
        await settled(running, dead_lettered=1)

        # Then the live part, as the page's script fetches it, shows it in the DLQ
        async def parked_shown() -> bool:
            live = await viewer.client.get("/overview/live")
            return card(live.text, "dead-letters") == "1"

        await wait_until(parked_shown)
        live = await viewer.client.get("/overview/live")
        assert live.headers["content-type"].startswith("text/html")
        assert "<html" not in live.text  # (a part, not a page)

        # and the worker's failures per second over the last minute (pid, processed, failures)
        async def failures_shown() -> bool:
            live = await viewer.client.get("/overview/live")
            cells = re.findall(r'<td class="num">([^<]*)</td>', live.text)
            return len(cells) >= 3 and cells[2] != "-" and float(cells[2]) > 0

        await wait_until(failures_shown)


async def test_the_charts_draw_the_hour_s_samples(settings: Settings, engine: AsyncEngine) -> None:
    # Given a process's samples 90, 60 and 30 s ago, processing 3 a second, with a work queue
    async with engine.begin() as conn:  # (one transaction: one now())
        for back, processed in ((90, 0), (60, 90), (30, 180)):
            written = replace(a_sample("p", processed=processed), gauges={Gauge.WORK_QUEUE: 40})
            await samples.insert_sample(conn, written)
            await conn.execute(
                text(
                    "UPDATE process_samples SET sampled_at = now() - make_interval(secs => :b) "
                    "WHERE id = (SELECT max(id) FROM process_samples)"
                ),
                {"b": back},
            )

    async with running_console(settings) as console, logged_in(console, VIEWER_TOKEN) as viewer:
        # When the charts are fetched
        charts = await viewer.client.get("/overview/charts")

    # Then each chart is inline SVG: the rate and the queue drawn, with their latest values
    assert charts.status_code == 200
    figures = re.split(r'<div class="chart" id="chart-\d">', charts.text)[1:]
    assert len(figures) == 4
    processed, failures, queue, outbox = figures
    assert re.search(r"now 3(\.0)?;", processed)  # (3, to the float's rounding)
    assert "<polyline" in processed
    assert "now 0;" in failures
    assert "now 40;" in queue
    assert "<polyline" in queue
    assert "no samples yet" in outbox
    assert "<polyline" not in outbox
    assert "<script" not in charts.text


HOSTILE = {
    "process": '"><svg onload=alert(1)>',
    "host": "<script>alert('host')</script>",
    "reason": "<img src=x onerror=alert(1)>",
    "state": 'consuming" onmouseover="alert(1)',
}


async def test_whatever_a_sample_holds_is_shown_inert(
    settings: Settings, engine: AsyncEngine
) -> None:
    # Given a sample whose texts are markup, as any process that can write the table could
    async with engine.begin() as conn:
        await samples.insert_sample(conn, replace(a_sample(HOSTILE["process"]), **HOSTILE))

    async with running_console(settings) as console, logged_in(console, VIEWER_TOKEN) as viewer:
        # When the overview shows it
        page = await viewer.client.get("/overview")
        live = await viewer.client.get("/overview/live")

    # Then every text is escaped: none is markup
    for shown in (page.text, live.text):
        assert "<script>alert" not in shown
        assert "<img src=x" not in shown
        assert "<svg onload" not in shown
        assert 'onmouseover="alert' not in shown
        assert escape(HOSTILE["host"]) in shown  # (as the templates escape it)
        assert escape(HOSTILE["reason"]) in shown


async def test_the_overview_and_its_parts_need_a_session(settings: Settings) -> None:
    async with (
        running_console(settings) as console,
        httpx.AsyncClient(base_url=console.url) as anonymous,
    ):
        for path in ("/overview", "/overview/live", "/overview/charts"):
            answer = await anonymous.get(path)
            assert answer.status_code == 303, path
            assert answer.headers["location"].startswith("/login?next=")
            assert "process" not in answer.text
