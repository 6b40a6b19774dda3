"""Outputs that cannot be forged or leak: what a message, a row or an error carries is printed by
the ``worker`` command as text on its own line (control characters escaped), and a command that
fails for an unexpected reason says so through the configured log format, redacted, exit 1."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import pytest
from aio_pika import Message
from aio_pika.abc import AbstractRobustConnection
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.helpers import WORKER_SCRIPT, run, worker_environ
from tests.integration.support import declare, park
from worker.logs import printable
from worker.settings import Settings
from worker.transport import dead_letters

FORGED = "2026-01-01 00:00:00,000 CRITICAL worker: forged"
HOSTILE = f"k\n{FORGED}\r\x1b[2J\x1b]0;pwned\x07\x85\u2028\u202eevil\x7f"
"""A value that would forge a line, clear the screen, retitle the terminal and flip the text."""


def assert_unforged(output: str) -> None:
    """Every line of ``output`` is printable and none starts as the forged record."""
    for line in output.split("\n"):
        assert line.isprintable(), repr(line)
        assert not line.startswith(FORGED[:10]), repr(line)


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("plain text, ünïcode and emoji 🙂", "plain text, ünïcode and emoji 🙂"),
        ("a\nb\r\tc", "a\\nb\\r\\tc"),
        ("\x00\x1b[31m\x7f", "\\x00\\x1b[31m\\x7f"),
        ("\x85\x9b", "\\x85\\x9b"),
        ("\u2028\u2029", "\\u2028\\u2029"),
        ("\u202eevil\u2066", "\\u202eevil\\u2066"),
        ("a literal \\n stays", "a literal \\n stays"),
        ("", ""),
    ],
)
def test_printable_escapes_what_could_end_a_line_or_drive_a_terminal(raw: str, shown: str) -> None:
    assert printable(raw) == shown
    assert printable(raw).isprintable()


def test_printable_escapes_every_control_character() -> None:
    controls = "".join(map(chr, [*range(0x20), *range(0x7F, 0xA0)]))
    assert printable(controls).isprintable()
    assert printable(controls).count("\\") == len(controls)


def broken_handler_module(tmp_path: Path) -> dict[str, str]:
    """A handler module that fails at import, its error quoting a URL with a password and a
    forged line; the environment that makes ``worker`` import it."""
    (tmp_path / "broken_handlers.py").write_text(
        "raise RuntimeError(\n"
        f"    'cannot reach postgresql://app:hunter2@db:5432/app' + {HOSTILE!r}\n"
        ")\n"
    )
    return {"PYTHONPATH": str(tmp_path), "WORKER_HANDLERS": "broken_handlers"}


def test_a_fatal_error_is_one_json_record_without_the_password(tmp_path: Path) -> None:
    result = run(WORKER_SCRIPT, "run", "--log-format", "json", **broken_handler_module(tmp_path))

    assert result.returncode == 1
    assert result.stdout == ""
    assert "hunter2" not in result.stderr
    (record,) = [json.loads(line) for line in result.stderr.splitlines()]
    assert record["level"] == "CRITICAL"
    assert record["message"].startswith("worker run failed: RuntimeError: cannot reach ")
    assert "postgresql://app:***@db:5432/app" in record["message"]
    assert record["exception"].startswith("Traceback (most recent call last):")
    assert HOSTILE in record["exception"]  # JSON keeps the text whole, escaped by json.dumps


def test_a_fatal_error_in_text_is_one_record_its_message_on_one_line(tmp_path: Path) -> None:
    result = run(WORKER_SCRIPT, "run", **broken_handler_module(tmp_path))

    assert result.returncode == 1
    assert "hunter2" not in result.stderr
    first, *traceback_lines = result.stderr.rstrip("\n").split("\n")
    assert " CRITICAL worker: worker run failed: RuntimeError: " in first
    assert traceback_lines[0] == "Traceback (most recent call last):"
    assert traceback_lines[-1].startswith("RuntimeError: cannot reach postgresql://app:***@db")
    assert "\\x1b[2J" in traceback_lines[-1]
    assert_unforged(result.stderr)


def test_a_command_that_cannot_reach_its_database_fails_in_json_without_the_password() -> None:
    for command in (["gc"], ["workflows"], ["outbox", "list"]):
        result = run(
            WORKER_SCRIPT,
            *command,
            "--log-format",
            "json",
            WORKER_DATABASE_URL="postgresql://postgres:hunter2@127.0.0.1:1/x",
        )

        assert result.returncode == 3, command
        assert "hunter2" not in result.stdout + result.stderr
        records = [json.loads(line) for line in (result.stdout + result.stderr).splitlines()]
        assert [r["level"] for r in records] == ["ERROR"], command
        assert (
            "cannot reach PostgreSQL at postgresql://postgres:***@127.0.0.1:1/x"
            in (records[0]["message"])
        )
        assert "ConnectionRefusedError" in records[0]["message"]
        assert "WORKER_DATABASE_URL" in records[0]["message"]
        assert "exception" not in records[0]


def test_a_configuration_error_still_exits_2_with_its_message() -> None:
    result = run(WORKER_SCRIPT, "run", "--log-format", "json")
    assert result.returncode == 2
    assert result.stderr.startswith("worker: error: no handlers")
    assert "Traceback" not in result.stderr


def test_an_unknown_log_level_is_a_usage_error() -> None:
    result = run(WORKER_SCRIPT, "gc", "--log-level", "LOUD")
    assert result.returncode == 2
    assert "log_level 'LOUD'" in result.stderr
    assert "Traceback" not in result.stderr


async def worker(settings: Settings, *argv: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(run, WORKER_SCRIPT, *argv, **worker_environ(settings))


async def test_dlq_list_prints_a_parked_messages_headers_as_text(
    settings: Settings, amqp: AbstractRobustConnection
) -> None:
    # Given a parked message whose failure headers carry escape codes and line breaks
    await declare(amqp, settings)
    channel = await amqp.channel(publisher_confirms=True)
    headers = {dead_letters.REASON: HOSTILE, dead_letters.HANDLER: HOSTILE, "idempotency-key": "k"}
    await channel.default_exchange.publish(
        Message(b"{}", headers=headers), routing_key=settings.dead_letter_queue
    )

    # When it is listed
    listed = await worker(settings, "dlq", "list")

    # Then it is one line, its headers shown as text (as the claims of a copy the worker has
    # no record of parking)
    assert listed.returncode == 0, listed.stderr
    assert_unforged(listed.stdout)
    (line,) = [line for line in listed.stdout.splitlines() if line.startswith("key=")]
    assert " reason=unverified " in line
    assert f"claims: reason={printable(repr(HOSTILE))} handler={printable(repr(HOSTILE))}" in line


async def test_workflows_status_verify_and_outbox_list_print_rows_as_text(
    settings: Settings, engine: AsyncEngine
) -> None:
    # Given a key in progress and a parked outbox row, both with hostile text
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "INSERT INTO inbox (handler, key, fingerprint, status, recovery_point, "
                "routing_key) VALUES ('payment.requested', :v, '', 'in_progress', :v, 'r')"
            ),
            {"v": HOSTILE},
        )
    await park(engine, settings, ordering_key=HOSTILE)

    # When each command shows them
    workflows = await worker(settings, "workflows")
    status = await worker(settings, "status")
    verify = await worker(settings, "verify", "--handlers", "examples.payments")
    outbox = await worker(settings, "outbox", "list")

    # Then each prints the hostile text escaped, on the line it belongs to
    assert workflows.returncode == 0, workflows.stderr
    assert f"key={printable(HOSTILE)} recovery_point={printable(HOSTILE)} " in workflows.stdout
    assert f"key={printable(HOSTILE)} " in status.stdout
    assert f"payment.requested/{printable(HOSTILE)}" in verify.stdout
    assert outbox.returncode == 0, outbox.stderr
    assert f"ordering_key={printable(HOSTILE)} " in outbox.stdout
    for result in (workflows, status, verify, outbox):
        assert_unforged(result.stdout)
        assert_unforged(result.stderr)
