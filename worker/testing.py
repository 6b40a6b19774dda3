"""Testing with the real PostgreSQL: a scratch database holding the worker's and a router's tables.

``scratch_database`` and ``empty_database`` run their own event loop, so call them outside one:
in a session-scoped pytest fixture, say, or before ``asyncio.run``.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from worker import schema
from worker.router import Router
from worker.settings import Settings


@contextlib.contextmanager
def scratch_database(
    settings: Settings, router: Router | None = None, *, prefix: str = "worker_scratch"
) -> Iterator[Settings]:
    """A new database beside ``settings.database_url``, migrated to head for the worker and
    ``router``'s handler modules; yields ``settings`` pointing at it and drops it on exit."""
    with empty_database(settings, prefix=prefix) as scratch:
        schema.upgrade(scratch, router)
        yield scratch


@contextlib.contextmanager
def empty_database(settings: Settings, *, prefix: str = "worker_scratch") -> Iterator[Settings]:
    """A new, empty database beside ``settings.database_url``; yields ``settings`` pointing at
    it and drops it on exit."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    _execute(settings.database_url, f'CREATE DATABASE "{name}"')
    try:
        parts = urlsplit(settings.database_url)
        yield settings.replace(database_url=urlunsplit(parts._replace(path="/" + name)))
    finally:
        _execute(settings.database_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _execute(url: str, sql: str) -> None:
    async def execute() -> None:
        conn = await asyncpg.connect(url)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(execute())
