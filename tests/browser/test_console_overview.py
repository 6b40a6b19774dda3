"""The overview in a real browser while a real worker (the payments example, in-process,
sampling itself every half second) processes messages: the page's live part changes without
the page being reloaded, and its charts draw the samples the worker wrote. Its screenshot adds
an hour of samples before the test's (``an_hour_before``), since a chart step is 30 s."""

from __future__ import annotations

import math

import pytest
from aio_pika.abc import AbstractRobustConnection
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from examples.payments import router as payments
from tests.browser.page import Page
from tests.helpers import payment
from tests.integration.console_support import VIEWER_TOKEN
from tests.integration.support import publish, running_worker, settled
from tests.integration.test_samples import until_sampled
from worker.settings import Settings
from worker.sql import samples
from worker.sql.samples import Gauge, NewSample
from worker.telemetry import Count

pytestmark = pytest.mark.integration

INTERVAL = 0.5
"""The worker's sample interval here."""

MARK = """
window.__sameDocument = "kept";
document.getElementById("live").__sameElement = "kept";
"""
"""Marks the document and the live part's element: both marks survive only while the browser
stays on the same document (a reload or a navigation makes a new one)."""

MARKED = """
return [window.__sameDocument, document.getElementById("live").__sameElement];
"""

READ_LIVE = """
function readLive() {
  const live = document.getElementById("live");
  const row = live.querySelector("#processes tbody tr[data-process]");
  const value = (id) => live.querySelector("#" + id + " .value").textContent.trim();
  return {
    refreshed: live.getAttribute("data-refreshed"),
    deadLetters: value("dead-letters"),
    workQueue: value("work-queue"),
    state: row ? row.children[3].textContent.trim() : null,
    processed: row ? row.children[6].textContent.trim() : null,
    failures: row ? row.children[7].textContent.trim() : null,
  };
}
"""
"""What the live part shows now: when the page's script last replaced it, the cards of the DLQ
and the work queue, and the worker's row (its state and its rates per second)."""

LIVE = READ_LIVE + "return readLive();"

CHANGED = (
    READ_LIVE
    + """
const seen = readLive();
const changed = seen.refreshed && seen.deadLetters === arguments[0]
  && Number(seen.processed) > 0 && Number(seen.failures) > 0;
return changed ? seen : null;
"""
)
"""What the live part shows, once the script has replaced it with one that shows
``arguments[0]`` dead letters, and the worker processing and failing messages."""

CHARTS = """
return Array.from(document.querySelectorAll("#charts .chart")).map((chart) => ({
  lines: chart.querySelectorAll("polyline").length,
  now: (chart.textContent.match(/now ([0-9.,-]+);/) || [null, null])[1],
}));
"""
"""Each chart's lines (how many runs it draws) and its latest value."""

EARLIER = "earlier-worker"
"""The process whose hour of samples ``an_hour_before`` writes."""


async def an_hour_before(engine: AsyncEngine) -> None:
    """The samples of a worker that ran the hour before this test's (and stopped shortly
    before it started, as in a restart), one a chart step (30 s): a throughput that rises and
    falls between about 10 and 50 messages a second, failures in bursts and a short backlog.
    The documentation's picture of an hour, which a test cannot wait for."""
    processed = failures = 0
    async with engine.begin() as conn:  # (one transaction: one now())
        for step in range(119):
            rate = 30 + 20 * math.sin(step / 9) + 5 * math.sin(step / 2)
            processed += round(rate * 30)
            failures += round(30 * max(0.0, 2 * math.sin(step / 4) - 1))
            backlog = max(0, round(40 * math.sin((step - 60) / 6))) if 55 < step < 80 else 0
            await samples.insert_sample(
                conn,
                NewSample(
                    process=EARLIER,
                    role="worker",
                    host="vm",
                    pid=1,
                    started_at=None,
                    state="consuming",
                    reason=None,
                    counters={Count.PROCESSED: processed, Count.DEAD_LETTERED: failures},
                    gauges={Gauge.WORK_QUEUE: backlog, Gauge.OUTBOX_BACKLOG: backlog // 4},
                ),
            )
        await conn.execute(
            text(
                "UPDATE process_samples AS s SET sampled_at = now() - make_interval(secs => "
                "3615 - 30 * n.step) FROM (SELECT id, row_number() OVER (ORDER BY id) AS step "
                "FROM process_samples WHERE process = :p) AS n WHERE s.id = n.id"
            ),
            {"p": EARLIER},
        )


async def traffic(amqp: AbstractRobustConnection, settings: Settings, count: int) -> None:
    """``count`` payments, one in ten invalid (so it is dead-lettered)."""
    async with amqp.channel(publisher_confirms=True) as channel:
        for n in range(count):
            body = payment(f"p-{n}") if n % 10 else {"payment_id": f"p-{n}"}
            await publish(channel, settings, body, key=f"k-{n}")


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """The test's settings, for the worker and the console: a sample every ``INTERVAL``."""
    return settings.replace(sample_interval=INTERVAL)


async def test_the_overview_changes_as_messages_flow_without_a_reload(
    page: Page, settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given a running worker that samples itself, and a user watching the overview
    async with running_worker(settings, payments) as running:
        await until_sampled(engine, "state = 'consuming'")
        await page.log_in(VIEWER_TOKEN, start="/overview")
        await page.wait_for_path("/overview")
        before = await page.script(LIVE)
        assert before["state"] == "consuming"
        assert before["deadLetters"] == "0"
        assert before["processed"] in ("-", "0")
        await page.script(MARK)

        # When payments flow, a few invalid ones among them
        await traffic(amqp, settings, 60)
        await settled(running, processed=54, dead_lettered=6)

        # Then the live part shows them, fetched by the page's script (every 5 s): the worker
        # processing and failing messages, the DLQ holding the invalid ones
        after = await page.wait_for(CHANGED, "6", timeout=30)
        assert after["refreshed"] != before["refreshed"]
        assert after["state"] == "consuming"
        # And the page is the one the user opened: never reloaded, never left
        assert await page.script(MARKED) == ["kept", "kept"]
        assert await page.path() == "/overview"

        # When the overview is opened again
        await page.open("/overview")
        await page.wait_for_path("/overview")

        # Then its charts of what was processed and what failed draw the traffic
        charts = await page.script(CHARTS)
        assert len(charts) == 4
        processed, failures = charts[0], charts[1]
        assert processed["lines"] > 0
        assert float(processed["now"].replace(",", "")) > 0
        assert failures["lines"] > 0
        assert float(failures["now"].replace(",", "")) > 0

        # (and the documentation's picture shows an hour of it)
        await an_hour_before(engine)
        await page.open("/overview")
        await page.wait_for_path("/overview")
        assert all(chart["lines"] for chart in await page.script(CHARTS))
        await page.screenshot("overview", whole=True)
