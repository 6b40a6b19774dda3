"""A workflow whose owner died holding it past its lease, with no message left to resume it:
``worker verify`` and the console's inbox page name it at once with the command that resumes it,
and ``worker workflows resume`` (a real process) resumes it through the outbox, once; a live
owner, a completed key and a wait still to come are refused."""

from __future__ import annotations

import asyncio
import json
import subprocess

from aio_pika.abc import AbstractRobustConnection
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.helpers import WORKER_SCRIPT, rows, run, scalar
from tests.integration.console_support import VIEWER_TOKEN, logged_in, running_console
from tests.integration.test_verify import run_checks
from tests.integration.waiting_handlers import CONFIRMED, ORDER, router
from worker.core.ownership import Ownership
from worker.core.signals import RESUME_HEADER
from worker.core.workflows import TIMER_HEADER
from worker.settings import Settings
from worker.sql import owners
from worker.testing import Harness

CREATE_EFFECTS = (
    "CREATE TABLE IF NOT EXISTS wait_effects "
    "(id bigserial PRIMARY KEY, key text NOT NULL, step text NOT NULL)"
)


async def confirmed_order(harness: Harness, engine: AsyncEngine, order_id: str) -> str:
    """An order whose wait its confirmation resolved (its resume message is in the outbox, and
    deleted: as if published and taken); the key of its workflow."""
    key = f"order-{order_id}"
    assert (await harness.deliver(ORDER, {"order_id": order_id}, key=key)).outcome == "waiting"
    await harness.deliver(CONFIRMED, {"order_id": order_id}, key=f"c-{order_id}")
    await execute(engine, "DELETE FROM outbox")
    return key


async def own(engine: AsyncEngine, key: str, owner: str, lease: str) -> None:
    await execute(
        engine,
        f"UPDATE inbox SET owner = :owner, lease_until = now() + interval '{lease}'"
        " WHERE key = :key",
        owner=owner,
        key=key,
    )


async def execute(engine: AsyncEngine, sql: str, **params: object) -> None:
    async with engine.begin() as conn:
        await conn.execute(text(sql), params)


async def resume(settings: Settings, *argv: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(
        run,
        WORKER_SCRIPT,
        "workflows",
        "resume",
        *argv,
        "--json",
        WORKER_DATABASE_URL=settings.database_url,
    )


async def test_an_orphaned_workflow_is_flagged_at_once_and_resumed_by_hand_once(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    await execute(engine, CREATE_EFFECTS)
    harness = Harness(router, engine)
    orphaned = await confirmed_order(harness, engine, "o-1")
    running = await confirmed_order(harness, engine, "o-2")
    handler = await scalar(engine, "SELECT handler FROM inbox WHERE key = :k", k=orphaned)

    # Given one workflow taken over by a process that died in it (its owner lock gone) a
    # moment after its lease ran out, and one whose live owner's step outlasts its lease
    async with Ownership(engine).held() as token:
        await own(engine, orphaned, owners.owner_of(token, "m-1", "run"), "-1 second")
    live = Ownership(engine)
    async with live.held() as token:
        await own(engine, running, owners.owner_of(token, "m-2", "run"), "-1 second")

        # When the checks run, and the console shows the first one
        checks = await run_checks(settings, engine, amqp)
        async with (
            running_console(settings) as console,
            logged_in(console, VIEWER_TOKEN) as viewer,
        ):
            pages = [
                (await viewer.client.get("/inbox", params={"handler": handler, "key": k})).text
                for k in (orphaned, running)
            ]

        # Then the dead one is flagged at once (not after stuck_after), with its command
        orphans = checks["no-orphaned-workflows"]
        assert not orphans.ok
        command = f"worker workflows resume {handler} {orphaned}"
        assert orphans.detail.startswith("1 workflow(s) held by a dead owner"), orphans.detail
        assert f"{handler}/{orphaned} (recovery point reserve" in orphans.detail
        assert "gone, lease until " in orphans.detail
        assert f"resume it: {command})" in orphans.detail
        assert checks["no-stuck-workflows"].ok
        assert 'id="orphaned"' in pages[0]
        assert f"<code>{command}</code>" in pages[0]
        assert 'id="orphaned"' not in pages[1]

        # And resuming the live one by hand is refused
        refused = await resume(settings, handler, running)
        assert refused.returncode == 1, refused.stderr
        assert "is run by a live owner" in json.loads(refused.stdout)["error"]

    # When the dead one is resumed by hand
    resumed = await resume(settings, handler, orphaned)

    # Then its resume message, naming its last wait, is in the outbox, and its owner released
    assert resumed.returncode == 0, resumed.stderr
    answer = json.loads(resumed.stdout)
    assert (answer["handler"], answer["key"], answer["wait"]) == (handler, orphaned, "shipped")
    [(message_id, headers)] = await rows(engine, "SELECT message_id::text, headers FROM outbox")
    assert message_id == answer["message_id"]
    assert headers[RESUME_HEADER] == "shipped"
    assert TIMER_HEADER not in headers
    assert await scalar(engine, "SELECT owner FROM inbox WHERE key = :k", k=orphaned) is None
    # (the other one's owner let go of its lock meanwhile, so it is flagged now)
    after = (await run_checks(settings, engine, amqp))["no-orphaned-workflows"].detail
    assert f"{handler}/{orphaned} " not in after
    assert f"{handler}/{running} " in after

    # And that message completes the workflow, its confirmed branch once
    [published] = await rows(engine, "SELECT body, headers FROM outbox")
    body = json.loads(bytes(published.body))
    again = await harness.deliver(
        ORDER, body, key=orphaned, message_id=message_id, headers=published.headers
    )
    assert again.outcome == "processed"
    effects = await rows(engine, "SELECT step FROM wait_effects WHERE key = :k", k=orphaned)
    assert [step for (step,) in effects] == ["reserve", "complete"]

    # And a completed key, an unknown one and a wait still to come are not resumed
    for key in (orphaned, "order-nobody"):
        refused = await resume(settings, handler, key)
        assert refused.returncode == 1, refused.stdout
    waiting = "order-o-3"
    assert (await harness.deliver(ORDER, {"order_id": "o-3"}, key=waiting)).outcome == "waiting"
    refused = await resume(settings, handler, waiting)
    assert refused.returncode == 1
    assert "for a deadline still to come" in json.loads(refused.stdout)["error"]
