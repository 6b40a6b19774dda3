"""Applying Alembic migrations: the worker's own, then each handler module's.

Each has its own history and version table (``alembic_version`` for the worker,
``alembic_version_<router name>`` for a handler module), so a handler module's revisions never
depend on the worker's revision ids. All share the env.py in ``worker/migrations``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy.ext.asyncio import AsyncEngine

from worker.core.router import Router
from worker.errors import ConfigurationError
from worker.settings import Settings
from worker.sql import maintenance, tables

MIGRATIONS = Path(__file__).parent / "migrations"
WORKER_VERSION_TABLE = "alembic_version"


def own_objects_only(
    obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any
) -> bool:
    """Alembic ``include_object``: leave alone the tables of other histories in the database."""
    return not (type_ == "table" and reflected and compare_to is None)


def _config() -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.set_main_option("path_separator", "os")
    return config


def worker_config(settings: Settings) -> Config:
    """The Alembic configuration of the worker's own tables."""
    config = _config()
    config.set_main_option("version_table", WORKER_VERSION_TABLE)
    config.attributes["database_url"] = settings.sqlalchemy_url
    config.attributes["target_metadata"] = tables.metadata
    return config


def handler_config(settings: Settings, router: Router) -> Config:
    """The Alembic configuration of a handler module's own tables."""
    assert router.migrations is not None
    assert router.name is not None
    config = _config()
    config.set_main_option("version_locations", str(router.migrations))
    config.set_main_option("version_table", f"{WORKER_VERSION_TABLE}_{router.name}")
    config.attributes["database_url"] = settings.sqlalchemy_url
    config.attributes["target_metadata"] = router.metadata
    return config


def configs(settings: Settings, router: Router | None) -> Iterator[Config]:
    """The worker's configuration, then each handler module's, in upgrade order."""
    yield worker_config(settings)
    if router is not None:
        for owner in router.with_migrations():
            yield handler_config(settings, owner)


def upgrade(settings: Settings, router: Router | None = None, revision: str = "head") -> None:
    """Bring the worker's tables and the handler modules' tables to ``revision``."""
    for config in configs(settings, router):
        command.upgrade(config, revision)


def downgrade(settings: Settings, router: Router | None = None, revision: str = "base") -> None:
    """Undo migrations, handler modules first (they were applied last)."""
    for config in reversed(list(configs(settings, router))):
        command.downgrade(config, revision)


def _history_name(config: Config) -> str:
    table = config.get_main_option("version_table") or WORKER_VERSION_TABLE
    if table == WORKER_VERSION_TABLE:
        return "worker"
    return table.removeprefix(f"{WORKER_VERSION_TABLE}_")


@functools.cache
def _heads(script_location: str, version_locations: str | None) -> frozenset[str]:
    """The head revisions of a history (read from its files once: code does not change)."""
    config = _config()
    config.set_main_option("script_location", script_location)
    if version_locations is not None:
        config.set_main_option("version_locations", version_locations)
    return frozenset(ScriptDirectory.from_config(config).get_heads())


async def pending(engine: AsyncEngine, settings: Settings, router: Router | None) -> list[str]:
    """The histories (``worker``, then each handler module's name) whose applied revisions are
    not their heads: the tables the code expects may be missing. Empty when all are current."""
    behind: list[str] = []
    async with engine.connect() as conn:
        for config in configs(settings, router):
            heads = _heads(
                config.get_main_option("script_location") or str(MIGRATIONS),
                config.get_main_option("version_locations"),
            )
            table = config.get_main_option("version_table") or WORKER_VERSION_TABLE
            if await maintenance.applied_revisions(conn, table) != heads:
                behind.append(_history_name(config))
    return behind


async def require_current(engine: AsyncEngine, settings: Settings, router: Router | None) -> None:
    """Refuse to start while migrations are pending: a handler would meet missing tables and
    every message would fail for the deployment's sake, not its own."""
    behind = await pending(engine, settings, router)
    if behind:
        handlers = f" --handlers {','.join(settings.handlers)}" if settings.handlers else ""
        raise ConfigurationError(
            f"the database schema is behind the code ({', '.join(behind)} not at head): "
            f"run `worker migrate{handlers}` first"
        )
