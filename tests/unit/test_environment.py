"""Which calls read the ``WORKER_*`` environment, and a PostgreSQL URL as ``psql`` takes it
accepted wherever a user gives one (``asyncpg_url``, ``engine_for``, ``engine_from_env``)."""

from __future__ import annotations

import pytest

from worker.database import engine_for, engine_from_env
from worker.errors import ConfigurationError
from worker.settings import Settings, asyncpg_url, field


def test_settings_load_reads_the_environment_and_settings_alone_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("WORKER_QUEUE", "from-the-environment")
    assert Settings.load().queue == "from-the-environment"
    assert Settings().queue == "worker"
    assert Settings(prefetch=10).queue == "worker"


def test_one_setting_is_read_without_the_others() -> None:
    environ = {"WORKER_EXCHANGE": "shop", "WORKER_PREFETCH": "not a number"}
    assert field("exchange").read(environ) == "shop"
    assert field("exchange").read({"WORKER_EXCHANGE": ""}) == "events"
    assert field("database_url").read({}) == Settings().database_url
    with pytest.raises(ConfigurationError, match=r"WORKER_PREFETCH='not a number'"):
        field("prefetch").read(environ)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("postgresql://u:p@db:5432/app", "postgresql+asyncpg://u:p@db:5432/app"),
        ("postgres://u@db/app?sslmode=require", "postgresql+asyncpg://u@db/app?sslmode=require"),
        ("postgresql+asyncpg://u@db/app", "postgresql+asyncpg://u@db/app"),
        ("postgresql://u@h1:5432,h2/app", "postgresql+asyncpg://u@/app?host=h1,h2&port=5432,5432"),
    ],
)
def test_asyncpg_url_takes_the_url_as_psql_does_and_is_idempotent(url: str, expected: str) -> None:
    assert asyncpg_url(url) == expected
    assert asyncpg_url(expected) == expected


@pytest.mark.parametrize("url", ["postgresql+psycopg://u@db/app", "u:secret@db/app", "mysql://x"])
def test_asyncpg_url_refuses_another_driver_without_showing_the_url(url: str) -> None:
    with pytest.raises(ConfigurationError, match="must be a postgresql:// URL") as refused:
        asyncpg_url(url)
    assert "secret" not in str(refused.value)


async def test_engines_take_a_plain_postgresql_url() -> None:
    plain = engine_for("postgresql://u@db/app?sslmode=disable")
    from_env = engine_from_env(
        {"WORKER_DATABASE_URL": "postgresql://u:pw@db:6543/app"}, pool_size=3
    )
    try:
        assert plain.url.drivername == from_env.url.drivername == "postgresql+asyncpg"
        assert (from_env.url.host, from_env.url.port, from_env.url.database) == ("db", 6543, "app")
        assert from_env.pool.size() == 3  # type: ignore[attr-defined]
    finally:
        await plain.dispose()
        await from_env.dispose()
