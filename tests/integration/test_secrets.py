"""No command prints a secret: distinctive secrets are planted in the settings (a database URL's
password and ``sslpassword=``, a broker URL's password, the ingress's tokens) and EVERY ``worker``
subcommand runs as a subprocess (its ``--help``; with the services reachable; with them
unreachable; at DEBUG), every line of its output searched for them."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Sequence
from urllib.parse import urlsplit, urlunsplit

import pytest
from aio_pika.abc import AbstractRobustConnection

from tests.helpers import WORKER_SCRIPT, free_port, worker_environ
from tests.integration.support import ROOT, declare
from worker.ops.cli import Exit, build_parser
from worker.settings import Settings

DATABASE_PASSWORD = "dbPw-Pl4nted-Q7x"
SSL_PASSWORD = "sslPw-Pl4nted-K2m"
QUERY_PASSWORD = "qPw-Pl4nted-Z9v"
BROKER_PASSWORD = "mqPw-Pl4nted-R4t"
TOKENS = ("tok-Pl4nted-first-0123456789", "tok-Pl4nted-second-9876543210")
SECRETS = (DATABASE_PASSWORD, SSL_PASSWORD, QUERY_PASSWORD, BROKER_PASSWORD, *TOKENS)
PLANTED = "Pl4nted"
"""In every secret, and in nothing else the worker could print."""

COMMAND_ARGS = {
    "dlq purge": ["--all"],
    "outbox retry": ["--all"],
    "demo": ["--count", "2"],
    "migrate": ["--no-declare"],
}
"""What a command needs beside the settings to do something."""

LONG_RUNNING = {"run", "relay", "serve"}
"""Commands that run until a signal: each gets SIGTERM after a few seconds."""


def subcommands() -> list[str]:
    """Every command of the parser, ``dlq list`` style for nested ones."""
    found: list[str] = []

    def walk(parser: object, prefix: str) -> None:
        for action in getattr(parser, "_actions", []):
            choices = getattr(action, "choices", None)
            if isinstance(choices, dict) and action.dest in {
                "command",
                "dlq_command",
                "outbox_command",
            }:
                for name, sub in choices.items():
                    full = f"{prefix} {name}".strip()
                    nested = [
                        a for a in sub._actions if isinstance(getattr(a, "choices", None), dict)
                    ]
                    if nested:
                        walk(sub, full)
                    else:
                        found.append(full)

    walk(build_parser(), "")
    return found


def with_password(url: str, password: str) -> str:
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    user = parts.username or "postgres"
    return urlunsplit(parts._replace(netloc=f"{user}:{password}@{host}"))


def planted_environ(settings: Settings, *, reachable: bool) -> dict[str, str]:
    """The settings with every secret planted; the URLs point at the test's services (the
    database trusts any password; the broker's URL keeps guest's) or at ports nobody serves."""
    database = (
        with_password(settings.database_url, DATABASE_PASSWORD) + f"?sslpassword={SSL_PASSWORD}"
    )
    broker = settings.amqp_url
    if not reachable:
        database = database.replace(
            urlsplit(database).netloc.rpartition("@")[2], f"127.0.0.1:{free_port()}"
        )
        broker = f"amqp://guest:{BROKER_PASSWORD}@127.0.0.1:{free_port()}/"
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("WORKER_")},
        "PYTHONPATH": str(ROOT),
        "COLUMNS": "200",
        **worker_environ(settings, WORKER_HANDLERS="examples.payments"),
        "WORKER_DATABASE_URL": database,
        "WORKER_AMQP_URL": broker,
        "WORKER_INGRESS_TOKENS": ",".join(TOKENS),
        "WORKER_INGRESS_PORT": str(free_port()),
        "WORKER_STARTUP_TIMEOUT": "1s",
    }


async def output_of(
    argv: Sequence[str], env: dict[str, str], *, stop_after: float | None
) -> tuple[int, str]:
    """Run ``worker argv``; SIGTERM after ``stop_after`` seconds if given; (status, output)."""
    process = await asyncio.create_subprocess_exec(
        str(WORKER_SCRIPT),
        *argv,
        env=env,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert process.stdout is not None
    reading = asyncio.create_task(process.stdout.read())
    try:
        try:
            await asyncio.wait_for(process.wait(), stop_after or 120)
        except TimeoutError:
            if stop_after is None:
                raise
            process.send_signal(signal.SIGTERM)
            await asyncio.wait_for(process.wait(), 90)
        out = await reading
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode is not None
    return process.returncode, out.decode(errors="replace")


def assert_no_secret(argv: Sequence[str], output: str) -> None:
    for number, line in enumerate(output.splitlines(), 1):
        assert PLANTED not in line, (
            f"`worker {' '.join(argv)}` line {number} shows a secret: {line}"
        )
    for secret in SECRETS:
        assert secret not in output


async def run_all(
    runs: list[tuple[list[str], dict[str, str], float | None]],
) -> list[tuple[list[str], int, str]]:
    """Each run, a few at a time (the machine is shared)."""
    limit = asyncio.Semaphore(3)

    async def one(
        argv: list[str], env: dict[str, str], stop_after: float | None
    ) -> tuple[list[str], int, str]:
        async with limit:
            status, output = await output_of(argv, env, stop_after=stop_after)
            return argv, status, output

    return list(await asyncio.gather(*(one(*run) for run in runs)))


def test_every_subcommand_is_found() -> None:
    commands = subcommands()
    assert {"run", "status", "dlq list", "dlq replay", "outbox retry", "verify"} <= set(commands)
    assert "dlq" not in commands


async def test_no_help_shows_a_secret(settings: Settings) -> None:
    env = planted_environ(settings, reachable=True)
    runs = [([*command.split(), "--help"], env, None) for command in subcommands()]
    runs.append((["--help"], env, None))
    for argv, status, output in await run_all(runs):
        assert status == Exit.OK, output
        assert "usage: worker" in output
        assert_no_secret(argv, output)


@pytest.mark.parametrize("reachable", [True, False], ids=["reachable", "unreachable"])
async def test_no_command_shows_a_secret(
    settings: Settings, amqp: AbstractRobustConnection, reachable: bool
) -> None:
    # Given every secret planted, and the test's topology declared
    await declare(amqp, settings)
    env = planted_environ(settings, reachable=reachable)
    # When every command runs (at DEBUG too, where the libraries say the most)
    runs = []
    for command in subcommands():
        argv = [*command.split(), *COMMAND_ARGS.get(command, [])]
        stop_after = (15.0 if reachable else 60.0) if command in LONG_RUNNING else None
        runs.append((argv, env, stop_after))
        if command in {"status", "gc", "run", "verify"}:
            runs.append(([*argv, "--log-level", "DEBUG"], env, stop_after))
    results = await run_all(runs)
    # Then no line of any output shows one
    for argv, _, output in results:
        assert_no_secret(argv, output)
    statuses = {" ".join(argv): status for argv, status, _ in results}
    if not reachable:
        assert statuses["status"] == Exit.UNREACHABLE
        assert statuses["gc"] == Exit.UNREACHABLE
        assert statuses["run"] == Exit.UNREACHABLE
    else:
        assert statuses["status"] == Exit.OK
        assert statuses["gc"] == Exit.OK


async def test_a_malformed_token_or_a_password_query_is_refused_without_its_value(
    settings: Settings,
) -> None:
    env = planted_environ(settings, reachable=True)
    bad_tokens = {**env, "WORKER_INGRESS_TOKENS": f"{TOKENS[0]},short-{PLANTED}"}
    password_query = {
        **env,
        "WORKER_DATABASE_URL": settings.database_url + f"?password={QUERY_PASSWORD}",
    }
    runs: list[tuple[list[str], dict[str, str], float | None]] = [
        (["serve"], bad_tokens, None),
        (["status"], bad_tokens, None),
        (["serve", "--ingress-tokens", f"{TOKENS[1]},x{PLANTED}"], env, None),
        (["status"], password_query, None),
        (
            ["gc", "--database-url", settings.database_url + f"?password={QUERY_PASSWORD}"],
            env,
            None,
        ),
    ]
    results = await run_all(runs)
    for argv, status, output in results:
        assert status == Exit.USAGE, output
        assert_no_secret(argv, output)
    serve_env, _, serve_flag = (output for _, _, output in results[:3])
    assert "WORKER_INGRESS_TOKENS" in serve_env
    assert "--ingress-tokens" in serve_flag
    status_query = results[3][2]
    assert "unknown query parameter 'password'" in status_query
