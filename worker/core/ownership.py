"""A process's proof of life as a workflow owner: one advisory lock (``worker.sql.owners``), held
on a connection of its own while any workflow of the process runs.

Invariant: every owner a run writes names a token whose lock this process holds until that run
has ended, so another process sees the owner dead exactly when it is: the lock goes with the
process's session (a SIGKILL, a lost connection), or once no run of it is left. A lock
connection lost while runs go on makes their owners look dead: a delivery may take one over
between two steps, never during one (the step's row lock), and the old run then stops at its next
step (``WorkflowBusy``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import weakref
from collections.abc import AsyncIterator

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from worker.sql import owners

log = logging.getLogger(__name__)

TOKEN_TRIES = 8
"""Random tokens tried before giving up (another live process holds each one tried)."""


class Ownership:
    """The owner lock of one engine's processes' workflow runs, shared by the runs at a time."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._guard = asyncio.Lock()
        self._runs = 0
        self._conn: AsyncConnection | None = None
        self._token = 0

    @contextlib.asynccontextmanager
    async def held(self) -> AsyncIterator[int]:
        """The token of a lock held until the block (and every other run's) has ended."""
        async with self._guard:
            if self._conn is None or self._conn.closed or self._conn.invalidated:
                await self._open()
            self._runs += 1
        try:
            yield self._token
        finally:
            async with self._guard:
                self._runs -= 1
                if not self._runs:
                    await self._close()

    async def _open(self) -> None:
        conn = await self.engine.connect()
        try:
            for _ in range(TOKEN_TRIES):
                token = secrets.randbelow(2**31 - 1) + 1
                async with conn.begin():
                    if await owners.try_lock_token(conn, token):
                        self._conn, self._token = conn, token
                        return
            raise RuntimeError(f"no free workflow owner token in {TOKEN_TRIES} tries")
        except BaseException:
            await conn.close()
            raise

    async def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            async with conn.begin():
                await owners.unlock_token(conn, self._token)
        except Exception as exc:  # its session ends with the connection: the lock with it
            log.debug("could not let go of the workflow owner lock: %s", exc)
            with contextlib.suppress(Exception):
                await conn.invalidate()
        finally:
            with contextlib.suppress(Exception):
                await conn.close()


_BY_ENGINE: weakref.WeakKeyDictionary[AsyncEngine, Ownership] = weakref.WeakKeyDictionary()


def ownership(engine: AsyncEngine) -> Ownership:
    """The one ``Ownership`` of ``engine`` in this process."""
    found = _BY_ENGINE.get(engine)
    if found is None:
        found = _BY_ENGINE[engine] = Ownership(engine)
    return found
