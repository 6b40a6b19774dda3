"""A logged-in user's page loads, idle and while anonymous clients attack the console.

``worker console`` runs in a process of its own (the real CLI, port 0) on a fresh database. A
user logs in once (a viewer: any live session takes the same pool); then, for each phase, it
GETs ``/audit`` ``--loads`` times, one after the other on its keep-alive connection, and the
latency of each load (request to whole answer) is taken:

1. ``idle``: nothing else talks to the console;
2. ``slow logins``: ``--clients`` (100) connections each send ``POST /login`` headers declaring a
   1,000-byte form and one byte of it, wait for the answer (a 408 when the form's deadline
   passes, a 503 when the anonymous requests' pool is full), and start again a second later,
   for the whole phase (``slow_logins``).

Printed beside each other: the loads answered 200, p50 and p99 (nearest rank) and the slowest,
with the ratio p99 under attack / p99 idle, and what the attackers were answered. Nothing here
asserts a timing (``tests/integration/test_console_hostile.py`` asserts that every load is
answered 200 under the attack). From the repository root::

    .venv/bin/python -m benchmarks.console_attack [--clients 100] [--loads 200]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import time
from collections import Counter
from collections.abc import AsyncIterator

import httpx

from benchmarks.console import console_process
from worker.settings import Settings
from worker.testing import scratch_database

SLOW_LOGIN = (
    b"POST /login HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    b"Content-Type: application/x-www-form-urlencoded\r\nContent-Length: 1000\r\n\r\nx"
)
"""A login form that declares 1,000 bytes and sends one."""
TOKEN = "bench-viewer-token-0123456789ab"
"""The logged-in user's (``benchmarks.console.console_process`` makes it a viewer's)."""
_CSRF = re.compile(r'name="login_csrf" value="([^"]+)"')


async def slow_login(port: int, stop: asyncio.Event, answers: Counter[int], pause: float) -> None:
    """One attacker: ``SLOW_LOGIN`` on a new connection, its answer's status counted (0: the
    connection closed unanswered), again ``pause`` seconds after each answer, until ``stop``."""
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            answers[-1] += 1
            await asyncio.sleep(pause)
            continue
        try:
            writer.write(SLOW_LOGIN)
            line = await _until(reader.readline(), stop)
            if line is None:
                return
            parts = line.split()
            answers[int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0] += 1
        except OSError:
            answers[0] += 1
        finally:
            writer.transport.abort()
        await _until(asyncio.sleep(pause), stop)


async def _until(work: object, stop: asyncio.Event) -> bytes | None:
    """``work``'s result, or None if ``stop`` is set first (``work`` is cancelled)."""
    task = asyncio.ensure_future(work)  # type: ignore[call-overload]
    stopped = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    for each in (task, stopped):
        if each not in done:
            each.cancel()
    return task.result() if task in done else None


@contextlib.asynccontextmanager
async def slow_logins(
    port: int, clients: int, *, pause: float = 1.0
) -> AsyncIterator[Counter[int]]:
    """``clients`` attackers (``slow_login``) for the block; yields what they were answered."""
    stop = asyncio.Event()
    answers: Counter[int] = Counter()
    tasks = [asyncio.create_task(slow_login(port, stop, answers, pause)) for _ in range(clients)]
    try:
        yield answers
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)


async def log_in(client: httpx.AsyncClient, token: str) -> None:
    """Log ``client`` in with ``token`` (it keeps the session cookie)."""
    form = await client.get("/login")
    found = _CSRF.search(form.text)
    assert found is not None, form.text
    answer = await client.post(
        "/login", data={"login_csrf": found.group(1), "token": token, "next": "/audit"}
    )
    assert answer.status_code == 303, answer.text


async def page_loads(client: httpx.AsyncClient, loads: int) -> tuple[list[float], Counter[int]]:
    """``loads`` GETs of ``/audit``, one after the other: their latencies and statuses."""
    latencies: list[float] = []
    statuses: Counter[int] = Counter()
    for _ in range(loads):
        started = time.perf_counter()
        answer = await client.get("/audit")
        latencies.append(time.perf_counter() - started)
        statuses[answer.status_code] += 1
    return latencies, statuses


def nearest_rank(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(share * len(ordered) + 0.5) - 1))]


async def run(settings: Settings, clients: int, loads: int) -> str:
    async with console_process(settings, TOKEN) as (_, url):
        port = int(url.rsplit(":", 1)[1])
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            await log_in(client, TOKEN)
            await page_loads(client, 20)  # (warm-up)
            idle, idle_statuses = await page_loads(client, loads)
            async with slow_logins(port, clients) as answers:
                await asyncio.sleep(2.0)  # (every attacker has sent its request)
                attacked, attacked_statuses = await page_loads(client, loads)
    rows = [("idle", idle, idle_statuses), ("slow logins", attacked, attacked_statuses)]
    lines = [
        f"logged-in GET /audit, {loads} loads each; {clients} slow anonymous logins in phase 2",
        f"{'phase':<12} {'200s':>6} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}",
    ]
    for label, latencies, statuses in rows:
        lines.append(
            f"{label:<12} {statuses[200]:>6} {nearest_rank(latencies, 0.5) * 1000:>8.1f} "
            f"{nearest_rank(latencies, 0.99) * 1000:>8.1f} {max(latencies) * 1000:>8.1f}"
        )
    ratio = nearest_rank(attacked, 0.99) / nearest_rank(idle, 0.99)
    lines.append(f"p99 under attack / idle: {ratio:.2f}x")
    lines.append(f"attackers answered: {dict(sorted(answers.items()))} (0: closed unanswered)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--loads", type=int, default=200)
    options = parser.parse_args(argv)
    with scratch_database(Settings.load(), prefix="worker_bench") as settings:
        print(asyncio.run(run(settings, options.clients, options.loads)))


if __name__ == "__main__":
    main()
