"""``worker console``: the operator console in a browser (``worker.console``)."""

from __future__ import annotations

import argparse
import asyncio

from worker.ops.cli.command import Command, import_extra
from worker.ops.cli.exits import until_signalled
from worker.settings import Group, Settings

CONSOLE_EXTRA = frozenset(
    {"fastapi", "starlette", "uvicorn", "h11", "anyio", "jinja2", "markupsafe"}
)
"""Top-level modules of the ``console`` extra's packages: ``worker console`` without one of them
says which extra to install."""


def _console(settings: Settings, args: argparse.Namespace) -> int:
    serve = import_extra(
        "worker.console.serve", command="console", extra="console", packages=CONSOLE_EXTRA
    )
    asyncio.run(
        until_signalled(
            lambda stop, started: serve.serve(settings, stop, started=lambda _port: started.set())
        )
    )
    return 0


CONSOLE = Command(
    "console",
    _console,
    "serve the operator console: processes, dead letters, outbox, inbox, audit",
    "Serve the operator console on console_host:console_port (127.0.0.1:8100) until "
    "SIGTERM/SIGINT: an overview of every worker and relay process, the dead letters grouped "
    "by reason and handler (replay, purge), the outbox (retry, hurry, cancel), an inbox "
    "lookup and the audit of every action. Log in with a token of console_operator_tokens or "
    "console_viewer_tokens (read-only); it refuses to start with neither. Needs the console "
    "extra: pip install 'rabbit-outbox-worker[console]'.",
    reads=(Group.CONSOLE, Group.RETRIES),
    aliases={"console_host": "--host", "console_port": "--port"},
)
