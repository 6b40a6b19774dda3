"""Several hosts in ``WORKER_DATABASE_URL``: what the worker hands SQLAlchemy's asyncpg dialect,
and so asyncpg, which tries the hosts in turn and keeps the first that matches
``target_session_attrs``. No services: the connection arguments are computed, not used."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy.dialects.postgresql.asyncpg import PGDialect_asyncpg

from worker.database import connect_options
from worker.errors import ConfigurationError
from worker.settings import Settings


def asyncpg_arguments(database_url: str) -> dict[str, Any]:
    """The keyword arguments the engine's dialect passes to ``asyncpg.connect``."""
    url, connect_args = connect_options(Settings(database_url=database_url).sqlalchemy_url)
    _, kwargs = PGDialect_asyncpg().create_connect_args(url)
    return {**kwargs, **connect_args}


def test_several_hosts_reach_asyncpg_as_lists_with_the_session_attributes() -> None:
    arguments = asyncpg_arguments(
        "postgresql://worker:pw@127.0.0.1:5441,127.0.0.1:5442/payments"
        "?target_session_attrs=read-write"
    )
    assert arguments == {
        "host": ["127.0.0.1", "127.0.0.1"],
        "port": [5441, 5442],
        "user": "worker",
        "password": "pw",
        "database": "payments",
        "target_session_attrs": "read-write",
    }


def test_libpq_query_form_of_several_hosts_is_understood_too() -> None:
    arguments = asyncpg_arguments("postgresql://worker@/payments?host=db1,db2&port=5432,5433")
    assert (arguments["host"], arguments["port"]) == (["db1", "db2"], [5432, 5433])


def test_tls_options_apply_to_every_host() -> None:
    arguments = asyncpg_arguments("postgresql://u@db1,db2/app?sslmode=disable")
    assert (arguments["host"], arguments["ssl"]) == (["db1", "db2"], False)


def test_one_host_is_left_as_it_was() -> None:
    arguments = asyncpg_arguments("postgresql://u@db:6432/app?target_session_attrs=primary")
    assert (arguments["host"], arguments["port"]) == ("db", 6432)
    assert arguments["target_session_attrs"] == "primary"


def test_hosts_given_twice_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="host is given more than once"):
        asyncpg_arguments("postgresql://u@db1,db2/app?host=db3")
