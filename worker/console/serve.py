"""``worker console``: the console under uvicorn, in this process's event loop, until stopped.

It runs under the ingress's server setup (``worker.ingress.serve.serve_app``: the connection cap,
the header deadline, a graceful stop), on ``console_host``:``console_port``, with the console's
security headers on what the server answers itself (a connection over the cap, a request it
cannot parse).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from worker import database, schema
from worker.backoff import while_starting
from worker.console.app import create_app
from worker.console.guard import SECURITY_HEADERS, secured
from worker.console.state import APPLICATION_NAME, POOL_SIZE
from worker.ingress.edge import overflow_app
from worker.ingress.serve import serve_app
from worker.settings import Settings, redact

log = logging.getLogger(__name__)


async def serve(
    settings: Settings, stop: asyncio.Event, *, started: Callable[[int], object] | None = None
) -> None:
    """Serve the console until ``stop`` is set; ``started`` gets the port once it listens."""
    engine = database.create_engine(
        settings, application_name=APPLICATION_NAME, pool_size=POOL_SIZE
    )
    try:
        app = create_app(settings, engine=engine)
        # (checked before listening, so a database that is behind is one sentence, not a
        # traceback from the application's startup)
        await while_starting(log, settings.startup_timeout)(
            schema.require_current, engine, settings, None
        )

        def listening(port: int) -> None:
            log.info(
                "serving the console on http://%s:%d (%d operator and %d read-only tokens; "
                "database %s)",
                settings.console_host,
                port,
                len(settings.console_operator_tokens),
                len(settings.console_viewer_tokens),
                redact(settings.database_url),
            )
            if started is not None:
                started(port)

        await serve_app(
            app,
            settings.console_host,
            settings.console_port,
            stop,
            listening,
            settings=settings,
            name="console",
            port_setting="console_port",
            overflow=lambda inner: secured(overflow_app(settings)(inner)),
            headers=SECURITY_HEADERS,
        )
    finally:
        await engine.dispose()
    log.info("the console stopped")
