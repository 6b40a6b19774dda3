"""The ``worker`` command, run for real as a subprocess; none of these reach a service."""

from __future__ import annotations

import os
import sys

import pytest

from tests.helpers import WORKER_SCRIPT, run
from worker.errors import ConfigurationError
from worker.ops.cli import _load_settings, build_parser
from worker.settings import FIELDS, Settings


def test_python_m_worker_help_lists_every_setting() -> None:
    result = run(sys.executable, "-m", "worker", "--help")
    assert result.returncode == 0, result.stderr
    for spec in FIELDS:
        assert spec.env in result.stdout
    for command in ("run", "migrate", "demo"):
        assert command in result.stdout


def test_run_help_mentions_its_flags_and_variables() -> None:
    result = run(WORKER_SCRIPT, "run", "--help")
    assert result.returncode == 0, result.stderr
    for text in ("--handlers", "--prefetch", "WORKER_DATABASE_URL", "worker.handlers"):
        assert text in result.stdout


def test_run_without_handlers_exits_2() -> None:
    result = run(WORKER_SCRIPT, "run", WORKER_HANDLERS="")
    assert result.returncode == 2
    assert "no handlers" in result.stderr


def test_run_with_a_zero_prefetch_flag_is_refused() -> None:
    result = run(WORKER_SCRIPT, "run", "--prefetch", "0")
    assert result.returncode != 0
    assert "--prefetch" in result.stderr


def test_run_with_a_bad_prefetch_variable_is_refused() -> None:
    result = run(WORKER_SCRIPT, "run", WORKER_PREFETCH="many")
    assert result.returncode == 2
    assert "WORKER_PREFETCH" in result.stderr


def test_run_with_a_missing_handler_module_exits_2_naming_it() -> None:
    result = run(WORKER_SCRIPT, "run", "--handlers", "no_such_module_xyz")
    assert result.returncode == 2
    assert "no_such_module_xyz" in result.stderr


def test_a_command_is_required() -> None:
    result = run(WORKER_SCRIPT)
    assert result.returncode == 2
    assert "COMMAND" in result.stderr


@pytest.fixture
def clean_environ(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in list(os.environ):
        if name.startswith("WORKER_"):
            monkeypatch.delenv(name)
    return monkeypatch


def test_a_flag_overrides_the_environment(clean_environ: pytest.MonkeyPatch) -> None:
    clean_environ.setenv("WORKER_QUEUE", "from-env")
    clean_environ.setenv("WORKER_PREFETCH", "5")
    args = build_parser().parse_args(["run", "--queue", "q"])
    settings = _load_settings(args)
    assert settings.queue == "q"
    assert settings.prefetch == 5


def test_without_flags_the_environment_applies(clean_environ: pytest.MonkeyPatch) -> None:
    clean_environ.setenv("WORKER_QUEUE", "from-env")
    args = build_parser().parse_args(["run"])
    assert _load_settings(args).queue == "from-env"


def test_flags_are_parsed_like_the_environment(clean_environ: pytest.MonkeyPatch) -> None:
    args = build_parser().parse_args(["run", "--handlers", "a, b,,c", "--max-body-bytes", "10"])
    settings = _load_settings(args)
    assert settings.handlers == ("a", "b", "c")
    assert settings.max_body_bytes == 10
    assert settings.queue == Settings().queue


def test_a_bad_environment_value_is_a_configuration_error(
    clean_environ: pytest.MonkeyPatch,
) -> None:
    clean_environ.setenv("WORKER_CONCURRENCY", "0")
    with pytest.raises(ConfigurationError, match="WORKER_CONCURRENCY"):
        _load_settings(build_parser().parse_args(["run"]))


@pytest.mark.parametrize(
    ("env", "flags", "expected"),
    [
        (None, [], True),
        ("false", [], False),
        ("off", ["--relay"], True),
        ("yes", ["--no-relay"], False),
    ],
)
def test_the_in_process_relay_is_on_unless_turned_off(
    clean_environ: pytest.MonkeyPatch, env: str | None, flags: list[str], expected: bool
) -> None:
    if env is not None:
        clean_environ.setenv("WORKER_RELAY", env)
    assert _load_settings(build_parser().parse_args(["run", *flags])).relay is expected


def test_the_relay_command_takes_the_relay_settings(clean_environ: pytest.MonkeyPatch) -> None:
    args = build_parser().parse_args(
        ["relay", "--relay-batch-size", "5", "--relay-retry-delay", "0.25", "--no-outbox-notify"]
    )
    settings = _load_settings(args)
    assert args.command == "relay"
    assert (settings.relay_batch_size, settings.relay_retry_delay) == (5, 0.25)
    assert settings.outbox_notify is False


def test_a_retention_shorter_than_the_retry_chain_is_refused_at_start() -> None:
    result = run(WORKER_SCRIPT, "run", "--handlers", "examples.payments", "--inbox-retention", "1m")
    assert result.returncode == 2
    assert "inbox_retention (1m) must be longer than the delayed-retry chain (71s)" in (
        result.stderr
    )


def test_every_command_is_listed() -> None:
    result = run(WORKER_SCRIPT, "--help")
    for command in ("run", "relay", "gc", "dlq", "migrate", "demo"):
        assert command in result.stdout
    dlq = run(WORKER_SCRIPT, "dlq", "--help")
    assert "list" in dlq.stdout
    assert "replay" in dlq.stdout
