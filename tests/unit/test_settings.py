"""Settings from a given environment and overrides; nothing here reads os.environ."""

from __future__ import annotations

import dataclasses

import pytest

from worker.errors import ConfigurationError
from worker.settings import (
    FIELDS,
    Field,
    Group,
    Settings,
    duration,
    format_duration,
    redact,
)


def test_an_empty_environment_gives_the_defaults() -> None:
    assert Settings.load({}) == Settings()


def test_values_come_from_the_environment() -> None:
    settings = Settings.load(
        {
            "WORKER_QUEUE": "jobs",
            "WORKER_PREFETCH": "7",
            "WORKER_HANDLERS": "a, b,,c",
            "WORKER_MAX_BODY_BYTES": "2048",
            "UNRELATED": "x",
        }
    )
    assert settings.queue == "jobs"
    assert settings.prefetch == 7
    assert settings.handlers == ("a", "b", "c")
    assert settings.max_body_bytes == 2048
    assert settings.exchange == Settings().exchange


def test_an_empty_variable_keeps_the_default() -> None:
    assert Settings.load({"WORKER_QUEUE": "", "WORKER_PREFETCH": ""}) == Settings()


def test_overrides_win_over_the_environment() -> None:
    settings = Settings.load({"WORKER_QUEUE": "env", "WORKER_PREFETCH": "7"}, queue="flag")
    assert (settings.queue, settings.prefetch) == ("flag", 7)


def test_none_overrides_are_ignored() -> None:
    settings = Settings.load({"WORKER_QUEUE": "env"}, queue=None, prefetch=None)
    assert (settings.queue, settings.prefetch) == ("env", Settings().prefetch)


@pytest.mark.parametrize("raw", ["0", "-3", "x", "1.5"])
def test_a_bad_prefetch_names_the_variable(raw: str) -> None:
    with pytest.raises(ConfigurationError, match="WORKER_PREFETCH"):
        Settings.load({"WORKER_PREFETCH": raw})


def test_every_field_is_a_settings_attribute_with_a_worker_variable() -> None:
    names = {spec.name for spec in FIELDS}
    assert names == set(Settings.__dataclass_fields__)
    assert all(spec.env == "WORKER_" + spec.name.upper() for spec in FIELDS)


def test_fields_derive_from_the_declaration_in_its_order() -> None:
    assert [spec.name for spec in FIELDS] == [f.name for f in dataclasses.fields(Settings)]
    for spec in FIELDS:
        assert spec.default == getattr(Settings(), spec.name), spec.name
        assert spec.flag == "--" + spec.name.replace("_", "-")
        assert isinstance(spec.group, Group), spec.name
        assert spec.help.strip(), spec.name


def test_every_group_has_a_setting() -> None:
    assert {spec.group for spec in FIELDS} == set(Group)


def test_switches_have_a_no_flag() -> None:
    relay = next(spec for spec in FIELDS if spec.name == "relay")
    assert relay.switch
    assert relay.flags == ("--relay", "--no-relay")
    assert [spec.flags for spec in FIELDS if spec.name == "prefetch"] == [("--prefetch",)]


@pytest.mark.parametrize(
    ("name", "shown"),
    [
        ("batch_linger", "2ms"),
        ("inbox_retention", "7d"),
        ("retry_delays", "1s,10s,1m"),
        ("handlers", "(none)"),
        ("relay", "true"),
        ("relay_retry_delay", "1.0"),
        ("prefetch", "400"),
    ],
)
def test_defaults_are_shown_as_users_write_them(name: str, shown: str) -> None:
    assert next(spec for spec in FIELDS if spec.name == name).shown_default == shown


@pytest.mark.parametrize(
    "spec", [spec for spec in FIELDS if spec.default != ()], ids=lambda spec: spec.name
)
def test_a_shown_default_parses_back_to_the_default(spec: Field) -> None:
    assert spec.parse(spec.shown_default) == spec.default


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("postgres://u:p@h:5432/db", "postgresql+asyncpg://u:p@h:5432/db"),
        ("postgresql://u:p@h:5432/db", "postgresql+asyncpg://u:p@h:5432/db"),
        ("postgresql+asyncpg://h/db", "postgresql+asyncpg://h/db"),
        # several hosts (libpq's form) go into the query, where SQLAlchemy's dialect reads them
        (
            "postgresql://u:p@10.0.0.1:5441,10.0.0.2:5442/db?target_session_attrs=read-write",
            "postgresql+asyncpg://u:p@/db?host=10.0.0.1,10.0.0.2&port=5441,5442"
            "&target_session_attrs=read-write",
        ),
        # a host without a port gets libpq's default; an IPv6 address loses its brackets
        (
            "postgresql://db1,[::1]:6432/app",
            "postgresql+asyncpg:///app?host=db1,::1&port=5432,6432",
        ),
    ],
)
def test_sqlalchemy_url_names_asyncpg(url: str, expected: str) -> None:
    assert Settings(database_url=url).sqlalchemy_url == expected


@pytest.mark.parametrize("url", ["mysql://u:p@h/db", "postgresql+psycopg://h/db"])
def test_sqlalchemy_url_refuses_other_databases(url: str) -> None:
    with pytest.raises(ConfigurationError, match="postgresql://"):
        _ = Settings(database_url=url).sqlalchemy_url


def test_redact_hides_the_password() -> None:
    redacted = redact("postgresql://alice:s3cret@db.example:5432/app?sslmode=require")
    assert redacted == "postgresql://alice:***@db.example:5432/app?sslmode=require"
    assert "s3cret" not in redacted


def test_redact_hides_a_password_containing_at_signs() -> None:
    redacted = redact("amqp://guest:p@ss@rabbit:5672/vhost")
    assert redacted == "amqp://guest:***@rabbit:5672/vhost"


def test_sqlalchemy_url_refuses_an_empty_host_in_a_list() -> None:
    with pytest.raises(ConfigurationError, match="empty host"):
        _ = Settings(database_url="postgresql://u@db1,,db2/app").sqlalchemy_url


def test_redact_hides_the_password_of_a_url_with_several_hosts() -> None:
    redacted = redact("postgresql://alice:s3cret@db1:5441,db2:5442/app?target_session_attrs=any")
    assert redacted == "postgresql://alice:***@db1:5441,db2:5442/app?target_session_attrs=any"


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://alice@db:5432/app",
        "amqp://rabbit:5672/",
        "postgresql:///app",
        "postgresql://alice@db1:5441,db2:5442/app?target_session_attrs=read-write",
    ],
)
def test_redact_leaves_a_url_without_password_as_it_is(url: str) -> None:
    assert redact(url) == url


def test_dead_letter_names_derive_from_the_queue() -> None:
    settings = Settings(queue="jobs")
    assert settings.dead_letter_queue == "jobs.dlq"
    assert settings.dead_letter_exchange == "jobs.dlx"


def test_replace_changes_only_what_it_names() -> None:
    base = Settings.load({"WORKER_QUEUE": "jobs"})
    changed = base.replace(prefetch=3)
    assert (changed.queue, changed.prefetch, base.prefetch) == ("jobs", 3, Settings().prefetch)


@pytest.mark.parametrize(
    ("raw", "expected"), [("true", True), ("ON", True), ("1", True), ("No", False), ("0", False)]
)
def test_switches_read_the_usual_spellings(raw: str, expected: bool) -> None:
    assert Settings.load({"WORKER_OUTBOX_NOTIFY": raw}).outbox_notify is expected


@pytest.mark.parametrize(
    ("name", "raw"),
    [
        ("WORKER_RELAY", "maybe"),
        ("WORKER_RELAY_RETRY_DELAY", "0"),
        ("WORKER_RELAY_POLL_INTERVAL", "nan"),
    ],
)
def test_a_bad_relay_setting_names_the_variable(name: str, raw: str) -> None:
    with pytest.raises(ConfigurationError, match=name):
        Settings.load({name: raw})


@pytest.mark.parametrize(
    ("raw", "seconds"),
    [
        ("90", 90.0),
        ("1.5", 1.5),
        ("500ms", 0.5),
        ("10s", 10.0),
        ("5m", 300.0),
        ("2h", 7200.0),
        ("7d", 604800.0),
        (" 3 M ", 180.0),
    ],
)
def test_durations_take_a_unit(raw: str, seconds: float) -> None:
    assert duration(raw) == seconds


@pytest.mark.parametrize("raw", ["", "x", "0", "-1s", "5y", "infd"])
def test_a_bad_duration_is_refused(raw: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        duration(raw)


@pytest.mark.parametrize(
    ("raw", "seconds"), [("0", 0.0), ("0ms", 0.0), ("0d", 0.0), ("2ms", 0.002)]
)
def test_a_linger_may_be_zero(raw: str, seconds: float) -> None:
    assert Settings.load({"WORKER_BATCH_LINGER": raw}).batch_linger == seconds


@pytest.mark.parametrize("raw", ["-1ms", "x", "nan", "infs"])
def test_a_bad_linger_is_refused(raw: str) -> None:
    with pytest.raises(ConfigurationError, match="WORKER_BATCH_LINGER"):
        Settings.load({"WORKER_BATCH_LINGER": raw})


def test_retry_delays_are_a_list_of_durations_or_none() -> None:
    assert Settings.load({"WORKER_RETRY_DELAYS": "1s, 10s,1m"}).retry_delays == (1.0, 10.0, 60.0)
    assert Settings.load({"WORKER_RETRY_DELAYS": "none"}).retry_delays == ()
    assert Settings().retry_queue(60.0) == "worker.retry.1m"
    assert Settings().retry_queue(0.25) == "worker.retry.250ms"


@pytest.mark.parametrize(("seconds", "text"), [(604800, "7d"), (90, "90s"), (0.5, "500ms")])
def test_format_duration_picks_the_largest_exact_unit(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_retention_must_outlast_the_retry_chain() -> None:
    with pytest.raises(ConfigurationError, match="inbox_retention"):
        Settings(inbox_retention=60.0, retry_delays=(30.0, 40.0))
    assert Settings(inbox_retention=71.0, retry_delays=(1.0, 10.0, 59.0)).inbox_retention == 71.0
