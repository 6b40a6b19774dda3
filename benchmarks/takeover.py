"""How long after a ``worker run`` is killed in the middle of a workflow's step the workflow
resumes, for this checkout and for a baseline checkout (``--baseline``, e.g. ``main`` in a
``git worktree``), in the same run.

For each tree: a fresh database beside ``WORKER_DATABASE_URL`` is migrated by that tree's own
``worker migrate --handlers examples.orders``; a ``worker run`` of that tree (its code first on
``PYTHONPATH``, default settings: a 30 s ``workflow_lease`` and the default retry chain) takes
one order and kills itself (SIGKILL, ``WORKER_CRASH_AT``) inside ``charge_payment``, before its
commit, its lease running; a second ``worker run`` starts at once. Timed: from the first
process's exit to the order's workflow waiting for its shipping confirmation (it resumed and
charged), polled every ``POLL`` seconds. The restart's own start-up is inside the figure. A
baseline whose owner is seen dead only when its lease runs out waits out the lease plus the
next step of the retry chain. The exchange and queues on ``WORKER_AMQP_URL`` are named
``bench-<hex>-takeover-...`` and deleted at the end; the databases are dropped. From the
repository root::

    .venv/bin/python -m benchmarks.takeover [--baseline /tmp/wf-main] [--rounds 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import aio_pika
from sqlalchemy import text

from benchmarks.relay_latency import delete_broker_objects
from examples.orders import add_stock
from worker.database import create_engine
from worker.settings import Settings, positive_int
from worker.testing import empty_database

ROOT = Path(__file__).resolve().parent.parent
POLL = 0.1
"""Seconds between two looks at the workflow."""
LIMIT = 150.0
"""Seconds a resume may take before the round is given up."""
CRASH = "workflow.before_commit:charge_payment"
KEY = "order-bench-1"
WAITING = (
    "SELECT count(*) FROM inbox i JOIN workflow_waits w USING (handler, key)"
    " WHERE i.key = :key AND i.status = 'in_progress' AND i.owner IS NULL AND w.outcome IS NULL"
)


def environ(tree: Path, settings: Settings, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKER_")}
    env.update(
        PYTHONPATH=str(tree),
        WORKER_DATABASE_URL=settings.database_url,
        WORKER_AMQP_URL=settings.amqp_url,
        WORKER_EXCHANGE=settings.exchange,
        WORKER_QUEUE=settings.queue,
        WORKER_HANDLERS="examples.orders",
        WORKER_HTTP_PORT="0",
        **extra,
    )
    return env


def start(tree: Path, settings: Settings, log: Path, **extra: str) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "worker", "run"],
            cwd=tree,
            env=environ(tree, settings, **extra),
            stdout=out,
            stderr=subprocess.STDOUT,
        )


async def place_order(settings: Settings) -> None:
    connection = await aio_pika.connect(settings.amqp_url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(settings.exchange)
        body = {"order_id": "bench-1", "sku": "tea", "quantity": 2, "amount_cents": 700}
        message = aio_pika.Message(
            json.dumps({**body, "account": "ann"}).encode(),
            content_type="application/json",
            message_id=uuid.uuid4().hex,
            headers={"idempotency-key": KEY},
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        )
        await exchange.publish(message, routing_key="order.placed")


def one_round(tree: Path, base: Settings, log: Path) -> float:
    """Seconds from the kill inside a step to the workflow resumed, with ``tree``'s code."""
    tag = f"bench-{uuid.uuid4().hex[:8]}-takeover"
    with empty_database(base, prefix="worker_bench") as db:
        settings = db.replace(exchange=f"{tag}-events", queue=f"{tag}-worker")
        migrate = [sys.executable, "-m", "worker", "migrate", "--handlers", "examples.orders"]
        env = environ(tree, settings)
        subprocess.run(migrate, cwd=tree, env=env, check=True, capture_output=True)
        return asyncio.run(killed_and_resumed(tree, settings, log))


async def killed_and_resumed(tree: Path, settings: Settings, log: Path) -> float:
    engine = create_engine(settings)
    try:
        async with engine.begin() as conn:
            await add_stock(conn, "tea", 10)
        victim = start(tree, settings, log, WORKER_CRASH_AT=CRASH)
        try:
            await asyncio.sleep(3)  # its topology declared, its consumer up
            await place_order(settings)
            await asyncio.to_thread(victim.wait, LIMIT)
        finally:
            if victim.poll() is None:
                victim.kill()
        if victim.returncode != -signal.SIGKILL:
            raise RuntimeError(f"the worker did not die at {CRASH}: see {log}")
        killed = time.monotonic()
        restarted = start(tree, settings, log)
        try:
            while time.monotonic() - killed < LIMIT:
                async with engine.connect() as conn:
                    found = (await conn.execute(text(WAITING), {"key": KEY})).scalar()
                if found:
                    return time.monotonic() - killed
                await asyncio.sleep(POLL)
            raise RuntimeError(f"not resumed within {LIMIT:.0f} s: see {log}")
        finally:
            restarted.send_signal(signal.SIGTERM)
            await asyncio.to_thread(restarted.wait, 30)
    finally:
        await engine.dispose()
        await delete_broker_objects(settings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, help="a checkout to compare with")
    parser.add_argument("--rounds", type=positive_int, default=1)
    args = parser.parse_args()
    base = Settings.load()
    trees = [("this checkout", ROOT)]
    if args.baseline is not None:
        trees.insert(0, ("baseline", args.baseline.resolve()))
    log = Path(tempfile.mkdtemp(prefix="takeover-")) / "worker.log"
    figures: dict[str, list[float]] = {name: [] for name, _ in trees}
    for _ in range(args.rounds):
        for name, tree in trees:
            figures[name].append(one_round(tree, base, log))
    print(f"kill inside a step ({CRASH}) -> workflow resumed; worker log {log}")
    for name, tree in trees:
        seconds = ", ".join(f"{s:.1f}" for s in figures[name])
        print(f"  {name:14} {tree}: {seconds} s")
    if args.baseline is not None:
        ratio = min(figures["baseline"]) / min(figures["this checkout"])
        print(f"  baseline / this checkout (best rounds): {ratio:.1f}x")


if __name__ == "__main__":
    main()
