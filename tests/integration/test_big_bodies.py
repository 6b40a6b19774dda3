"""Wide bodies (80,000 names in 870 KB) from a few clients at once, against a real ``worker
serve`` and a real ``worker run``: each is refused (413) or parked (``body-too-large``) before it
is parsed, a large body within the limits is still accepted and handled, and ``/healthz`` is
probed all along (its latency printed beside the idle one, never asserted: benchmarks.ingress
measures it)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
from aio_pika.abc import AbstractRobustConnection
from sqlalchemy.ext.asyncio import AsyncEngine

from benchmarks.ingress import probe
from tests.helpers import payment, scalar, wait_until
from tests.integration.support import (
    dead_letters,
    publish,
    ready_messages,
    wait_for_consumer,
    worker_process,
)
from tests.integration.test_ingress import (
    REQUESTED,
    is_problem,
    keyed,
    nothing_stored,
    served_port,
    start_serve,
)
from tests.integration.test_poison import with_endpoint
from worker.settings import Settings

ATTACKERS = 3
BODIES_EACH = 4


def wide_payment(payment_id: str, names: int = 80_000) -> bytes:
    """A valid payment with ``names`` names more (870 KB for 80,000): within max_body_bytes."""
    return json.dumps(
        payment(payment_id) | {f"k{i:05d}": 1 for i in range(names)}, separators=(",", ":")
    ).encode()


async def probes_while(port: int, attack: asyncio.Future[Any]) -> list[tuple[int | None, float]]:
    """``/healthz`` probed every 50 ms until ``attack`` is done (at least once)."""
    answers = [await probe(port, within=60)]
    while not attack.done():
        answers.append(await probe(port, within=60))
        await asyncio.sleep(0.05)
    return answers


def shown(label: str, answers: list[tuple[int | None, float]]) -> str:
    slowest = max(seconds for _, seconds in answers)
    return f"{label}: {len(answers)} /healthz probes, slowest {1000 * slowest:.1f} ms"


async def test_wide_bodies_posted_by_clients_at_once_are_413_before_they_are_parsed(
    settings: Settings, engine: AsyncEngine, tmp_path: Path
) -> None:
    log = tmp_path / "serve.log"
    process = start_serve(settings, log)
    try:
        port = await served_port(log)
        url = f"http://127.0.0.1:{port}"
        idle = [await probe(port) for _ in range(5)]

        # When a few clients post wide bodies at once (made before: the probes share this loop)
        bodies = [wide_payment(f"w{i}") for i in range(BODIES_EACH)]

        async def attacker(n: int) -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                return [
                    await client.post(REQUESTED, content=body, headers=keyed(f"w{n}-{i}"))
                    for i, body in enumerate(bodies)
                ]

        attack = asyncio.ensure_future(asyncio.gather(*(attacker(n) for n in range(ATTACKERS))))
        under = await probes_while(port, attack)
        answers = [response for each in await attack for response in each]

        # Then each is refused as too large, and nothing is stored of it
        assert len(answers) == ATTACKERS * BODIES_EACH
        for response in answers:
            assert is_problem(response, 413, "body-too-large"), response.text
            assert "max_json_items" in response.json()["detail"]
        assert await nothing_stored(engine)
        assert {status for status, _ in idle + under} == {200}
        print(shown("idle", idle), "|", shown("under wide bodies", under))

        # and a large body within the limits (over 16 KiB, off the event loop) is accepted
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            fine = await client.post(
                REQUESTED, content=wide_payment("fine", names=5_000), headers=keyed("fine")
            )
        assert fine.status_code == 202, fine.text
    finally:
        process.terminate()
        await asyncio.to_thread(process.wait, 30)


async def test_wide_messages_are_parked_as_too_large_and_good_ones_still_handled(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection, tmp_path: Path
) -> None:
    settings = with_endpoint(settings)
    endpoint = {"WORKER_HTTP_HOST": "127.0.0.1", "WORKER_HTTP_PORT": str(settings.http_port)}
    log = tmp_path / "worker.log"
    with worker_process(settings, log, WORKER_HANDLERS="examples.payments", **endpoint):
        await wait_for_consumer(amqp, settings.queue)
        idle = [await probe(settings.http_port) for _ in range(5)]
        channel = await amqp.channel()

        # When ten wide messages are published, with a large good one and a small one behind
        wide = [wide_payment(f"w{i}") for i in range(10)]
        large = wide_payment("large", names=5_000)

        async def publishing() -> None:
            for i, body in enumerate(wide):
                await publish(channel, settings, body, key=f"wide-{i}")
            await publish(channel, settings, large, key="large")
            await publish(channel, settings, payment("small"), key="small")

        async def all_handled() -> bool:
            handled = "SELECT count(*) FROM inbox WHERE key IN ('large', 'small')"
            parked = await ready_messages(channel, settings.dead_letter_queue)
            return parked == len(wide) and await scalar(engine, handled) == 2

        async def published_and_handled() -> None:
            await publishing()
            await wait_until(all_handled, timeout=60)

        attack = asyncio.ensure_future(published_and_handled())
        under = await probes_while(settings.http_port, attack)
        await attack

        # Then each wide one is parked once as body-too-large, the good ones are handled
        parked = await dead_letters(channel, settings)
        assert sorted(str(m.headers["idempotency-key"]) for m in parked) == sorted(
            f"wide-{i}" for i in range(10)
        )
        assert {m.headers["x-worker-reason"] for m in parked} == {"body-too-large"}
        assert all("max_json_items" in str(m.headers["x-worker-error"]) for m in parked)
        assert await scalar(engine, "SELECT count(*) FROM inbox WHERE status <> 'completed'") == 0
        assert {status for status, _ in idle + under} == {200}
        print(shown("idle", idle), "|", shown("under wide messages", under))
