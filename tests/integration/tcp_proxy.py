"""A TCP proxy a test can cut: the worker talks to PostgreSQL through it, and ``down()`` makes
the server unreachable (every connection dropped, new ones refused) until ``up()``. Given an
``ssl`` context it terminates TLS, so a plain server can be reached as a TLS one. With
``close_delay`` set, a connection the server closes is closed to the client that much later:
what the server sent last has arrived well before its end, as on a slow path."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable


class TcpProxy:
    """Forwards 127.0.0.1:<port> to ``target_host:target_port`` while up."""

    def __init__(
        self, target_host: str, target_port: int, *, tls: ssl.SSLContext | None = None
    ) -> None:
        self.target = (target_host, target_port)
        self.tls = tls
        self.port = 0
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self.close_delay = 0.0
        """Seconds between the server's end of a connection and its end to the client."""

    async def up(self) -> None:
        """Accept connections (on the same port as before, if there was one)."""
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port, ssl=self.tls)
        self.port = self._server.sockets[0].getsockname()[1]

    async def down(self) -> None:
        """Refuse new connections and reset every open one."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for writer in list(self._writers):
            writer.transport.abort()
        for pipe in list(self._pipes):
            pipe.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, up_writer}
        pipes = [
            asyncio.create_task(self._pipe(reader, up_writer)),
            asyncio.create_task(self._pipe(up_reader, writer, then_wait=self._close_delayed)),
        ]
        self._pipes.update(pipes)
        try:
            await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pipe in pipes:
                pipe.cancel()
                self._pipes.discard(pipe)
            for w in (writer, up_writer):
                self._writers.discard(w)
                w.transport.abort()

    async def _close_delayed(self) -> None:
        await asyncio.sleep(self.close_delay)

    @staticmethod
    async def _pipe(
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        then_wait: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if then_wait is not None:
            await then_wait()


@contextlib.asynccontextmanager
async def tcp_proxy(
    target_host: str, target_port: int, *, tls: ssl.SSLContext | None = None
) -> AsyncIterator[TcpProxy]:
    proxy = TcpProxy(target_host, target_port, tls=tls)
    await proxy.up()
    try:
        yield proxy
    finally:
        await proxy.down()
