"""Alembic environment shared by the worker's migrations and every handler module's.

The database URL comes from the caller (``worker migrate``) or from the worker's settings
(``WORKER_DATABASE_URL``); the engine is made as the worker's are (``database.engine_for``: the
same TLS options, parameters kept out of errors, a refused login raised as ``AccessRefused``).
The version table and the metadata come from the Alembic config, so each history only ever
sees, and autogenerates for, its own tables.
"""

from __future__ import annotations

import asyncio
import importlib
from logging.config import fileConfig
from typing import Any

from alembic import context
from sqlalchemy import MetaData
from sqlalchemy.engine import Connection

from worker.database import connect_options, engine_for
from worker.errors import refusals_explained
from worker.schema import own_objects_only
from worker.settings import Settings
from worker.sql import tables

config = context.config
if config.config_file_name is not None and config.get_section("loggers") is not None:
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def _target_metadata() -> MetaData | None:
    if "target_metadata" in config.attributes:
        metadata: MetaData | None = config.attributes["target_metadata"]
        return metadata
    spec = config.get_main_option("target_metadata")
    if not spec:
        return tables.metadata
    module_name, _, attribute = spec.partition(":")
    found: MetaData = getattr(importlib.import_module(module_name), attribute or "metadata")
    return found


target_metadata = _target_metadata()
version_table = config.get_main_option("version_table") or "alembic_version"
database_url = config.attributes.get("database_url") or Settings.load().sqlalchemy_url


def _configure(connection: Connection | None = None, **kwargs: Any) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        version_table=version_table,
        include_object=own_objects_only,
        compare_type=True,
        **kwargs,
    )


def _run_sync(connection: Connection) -> None:
    _configure(connection)
    with context.begin_transaction():
        context.run_migrations()


async def _run_online() -> None:
    engine = engine_for(database_url, application_name="worker-migrate")
    try:
        with refusals_explained():
            async with engine.connect() as connection:
                await connection.run_sync(_run_sync)
                await connection.commit()
    finally:
        await engine.dispose()


if context.is_offline_mode():
    url, _ = connect_options(database_url)
    _configure(url=url, literal_binds=True, dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()
else:
    asyncio.run(_run_online())
