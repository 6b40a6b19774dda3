"""The ``worker`` command, run for real as a subprocess; none of these reach a service."""

from __future__ import annotations

import argparse
import ast
import os
import re
import sys
import uuid
from pathlib import Path

import pytest

from tests.helpers import WORKER_SCRIPT, run
from worker.errors import ConfigurationError
from worker.ops import cli
from worker.ops.cli import (
    COMMANDS,
    EVERY_COMMAND,
    LEAVES,
    READS,
    Family,
    build_parser,
    load_settings,
)
from worker.ops.cli.run import SERVE
from worker.settings import FIELDS, Field, Group, Settings

NEEDS = {
    "outbox retry": ["--all"],
    "outbox cancel": ["6f1c0d2e-8d5b-4f5e-9a57-1f1e3c2d4b5a"],
    "dlq show": ["sha256:0"],
}
"""Arguments a command cannot be parsed without."""

DEPLOYMENT = {
    "database_url": "postgresql://u@db/x",
    "amqp_url": "amqp://u@mq/",
    "startup_timeout": "5s",
    "exchange": "ex",
    "queue": "q",
    "queue_type": "quorum",
    "delivery_limit": "5",
    "handlers": "examples.payments",
    "installed_handlers": "false",
    "log_level": "DEBUG",
    "log_format": "json",
    "tcp_keepalive_idle": "3s",
    "tcp_user_timeout": "20s",
    "database_connect_timeout": "7s",
    "database_timeout": "1m",
    "broker_heartbeat": "15",
}
"""Where the deployment is and how to log: scripts pass these flags to every command."""


def leaf_commands(
    parser: argparse.ArgumentParser, path: str = ""
) -> dict[str, argparse.ArgumentParser]:
    """Every command that runs something (``dlq list``, not ``dlq``) and its parser."""
    found: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found |= leaf_commands(sub, f"{path} {name}".strip())
    return found or {path: parser}


def mentions(text: str, word: str) -> int:
    """How often ``word`` (a flag or a variable) occurs in ``text`` as a word of its own."""
    return len(re.findall(rf"(?<![\w-]){re.escape(word)}(?![\w-])", text))


def test_python_m_worker_help_points_to_each_commands_settings() -> None:
    result = run(sys.executable, "-m", "worker", "--help")
    assert result.returncode == 0, result.stderr
    assert "Each command's --help lists the settings it reads" in result.stdout
    assert "WORKER_* environment variable" in result.stdout
    for command in ("run", "migrate", "demo"):
        assert command in result.stdout


def test_every_command_declares_what_it_reads() -> None:
    assert set(leaf_commands(build_parser())) == set(READS)


def test_each_command_is_declared_once_under_its_familys_name() -> None:
    names = [command.name for command in LEAVES]
    assert len(names) == len(set(names))
    for family in (entry for entry in COMMANDS if isinstance(entry, Family)):
        assert all(command.name.startswith(f"{family.name} ") for command in family.commands)


def test_no_function_of_the_command_package_is_over_80_lines() -> None:
    package = Path(cli.__file__).parent
    long = [
        f"{module.name}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for module in sorted(package.glob("*.py"))
        for node in ast.walk(ast.parse(module.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > 80
    ]
    assert long == []


def test_run_reads_every_group_but_the_ingress_and_the_console() -> None:
    """``worker run`` is a complete deployment of the worker; the HTTP ingress runs apart, in
    ``worker serve``, and the console in ``worker console``."""
    assert set(READS["run"]) == set(Group) - {Group.INGRESS, Group.CONSOLE}


@pytest.mark.parametrize("command", list(READS))
def test_each_command_takes_the_deployment_flags(
    command: str, clean_environ: pytest.MonkeyPatch
) -> None:
    assert all(group in READS[command] for group in EVERY_COMMAND)
    flags = [_flag(spec, DEPLOYMENT[spec.name]) for spec in _deployment()]
    args = build_parser().parse_args([*command.split(), *flags, *NEEDS.get(command, [])])
    settings = load_settings(args)
    deployment = {spec.name: spec.parse(DEPLOYMENT[spec.name]) for spec in _deployment()}
    assert settings == Settings.load({}, **deployment)


def test_outbox_cancel_takes_message_ids_as_uuids_each_once_in_the_order_given() -> None:
    first, second = uuid.uuid4(), uuid.uuid4()
    args = build_parser().parse_args(
        ["outbox", "cancel", str(first), str(second).upper(), "--dry-run"]
    )
    assert args.message_ids == [first, second]
    assert args.dry_run


def test_the_deployment_flags_are_the_groups_every_command_takes() -> None:
    assert {spec.name for spec in _deployment()} == set(DEPLOYMENT)


def _deployment() -> list[Field]:
    return [spec for spec in FIELDS if spec.group in EVERY_COMMAND]


def _flag(spec: Field, value: str) -> str:
    """``--name=value``, or for a switch ``--name`` / ``--no-name``."""
    if spec.switch:
        return spec.flags[0] if spec.parse(value) else spec.flags[1]
    return f"{spec.flag}={value}"


@pytest.mark.parametrize("command", list(READS))
def test_each_command_refuses_the_flags_it_does_not_read(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = build_parser()
    for spec in (spec for spec in FIELDS if spec.group not in READS[command]):
        for flag in spec.flags:
            with pytest.raises(SystemExit) as exited:
                parser.parse_args([*command.split(), flag, *NEEDS.get(command, [])])
            assert exited.value.code == 2
            readers = ", ".join(c for c, groups in READS.items() if spec.group in groups)
            assert (
                f"worker: error: {flag} is not a setting of {command!r} (it is read by: {readers})"
                in capsys.readouterr().err
            )


def test_a_refusal_names_every_command_that_reads_the_flag() -> None:
    result = run(WORKER_SCRIPT, "gc", "--relay-batch-size", "5")
    assert result.returncode == 2
    assert (
        "worker: error: --relay-batch-size is not a setting of 'gc' (it is read by: run, relay)"
        in result.stderr
    )


def test_dlq_list_refuses_batch_linger() -> None:
    result = run(WORKER_SCRIPT, "dlq", "list", "--batch-linger", "5")
    assert result.returncode == 2
    assert (
        "worker: error: --batch-linger is not a setting of 'dlq list' (it is read by: run)"
        in result.stderr
    )
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("argv", [["relay", "--relay"], ["gc", "--janitor"]])
def test_a_refused_flag_is_not_taken_for_a_longer_flag_it_begins(argv: list[str]) -> None:
    """``--relay`` begins ``--relay-batch-size``, which ``relay`` takes: argparse alone would
    call it ambiguous, or take it for the longer flag."""
    result = run(WORKER_SCRIPT, *argv)
    assert result.returncode == 2
    assert f"{argv[1]} is not a setting of {argv[0]!r} (it is read by: run)" in result.stderr


def test_an_unknown_flag_keeps_argparses_error() -> None:
    result = run(WORKER_SCRIPT, "status", "--no-such-flag")
    assert result.returncode == 2
    assert "unrecognized arguments: --no-such-flag" in result.stderr


def test_the_environment_still_sets_what_a_command_takes_no_flag_for(
    clean_environ: pytest.MonkeyPatch,
) -> None:
    clean_environ.setenv("WORKER_BATCH_LINGER", "5ms")
    clean_environ.setenv("WORKER_PREFETCH", "7")
    settings = load_settings(build_parser().parse_args(["dlq", "list"]))
    assert (settings.batch_linger, settings.prefetch) == (0.005, 7)


def test_run_help_mentions_each_flag_and_variable_once() -> None:
    result = run(WORKER_SCRIPT, "run", "--help")
    assert result.returncode == 0, result.stderr
    for spec in FIELDS:
        for word in (*spec.flags, spec.env):
            assert mentions(result.stdout, word) == (spec.group in READS["run"]), word
    assert re.search(r"\[WORKER_BATCH_LINGER; default 2ms\]", result.stdout)
    assert "[WORKER_RETRY_DELAYS; default 1s,10s,1m]" in result.stdout
    assert "--relay, --no-relay" in result.stdout
    assert "[WORKER_RELAY; default true]" in result.stdout


@pytest.mark.parametrize("command", list(READS))
def test_each_commands_help_shows_the_settings_it_reads_once_and_no_other(
    command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    help = leaf_commands(build_parser())[command].format_help()
    for spec in FIELDS:
        expected = 1 if spec.group in READS[command] else 0
        for word in (*spec.flags, spec.env):
            assert mentions(help, word) == expected, (word, help)
    assert "[--SETTING ...]" in help


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
    settings = load_settings(args)
    assert settings.queue == "q"
    assert settings.prefetch == 5


def test_without_flags_the_environment_applies(clean_environ: pytest.MonkeyPatch) -> None:
    clean_environ.setenv("WORKER_QUEUE", "from-env")
    args = build_parser().parse_args(["run"])
    assert load_settings(args).queue == "from-env"


def test_flags_are_parsed_like_the_environment(clean_environ: pytest.MonkeyPatch) -> None:
    args = build_parser().parse_args(["run", "--handlers", "a, b,,c", "--max-body-bytes", "10"])
    settings = load_settings(args)
    assert settings.handlers == ("a", "b", "c")
    assert settings.max_body_bytes == 10
    assert settings.queue == Settings().queue


def test_a_bad_environment_value_is_a_configuration_error(
    clean_environ: pytest.MonkeyPatch,
) -> None:
    clean_environ.setenv("WORKER_CONCURRENCY", "0")
    with pytest.raises(ConfigurationError, match="WORKER_CONCURRENCY"):
        load_settings(build_parser().parse_args(["run"]))


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
    assert load_settings(build_parser().parse_args(["run", *flags])).relay is expected


def test_the_relay_command_takes_the_relay_settings(clean_environ: pytest.MonkeyPatch) -> None:
    args = build_parser().parse_args(
        ["relay", "--relay-batch-size", "5", "--relay-retry-delay", "0.25", "--no-outbox-notify"]
    )
    settings = load_settings(args)
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


def test_serve_takes_host_and_port_as_short_flags(clean_environ: pytest.MonkeyPatch) -> None:
    args = build_parser().parse_args(["serve", "--host", "0.0.0.0", "--port", "8001"])
    settings = load_settings(args)
    assert (settings.ingress_host, settings.ingress_port) == ("0.0.0.0", 8001)
    assert load_settings(build_parser().parse_args(["serve"])).ingress_port == 8000


def test_serve_without_the_http_extra_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a Python where FastAPI cannot be imported (and the ingress was never imported)
    for name in [
        m for m in sys.modules if m == "worker.ingress" or m.startswith("worker.ingress.")
    ]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "fastapi", None)

    # Then `worker serve` is a configuration error (exit 2) naming the extra
    with pytest.raises(
        ConfigurationError, match=re.escape("pip install 'rabbit-outbox-worker[http]'")
    ):
        SERVE.run(Settings(handlers=("examples.payments",)), argparse.Namespace())
