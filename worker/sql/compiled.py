"""SQLAlchemy Core statements run on the asyncpg connection of their transaction, each statement
shape compiled once: a handler's ``ctx.connection.execute`` without SQLAlchemy's execution layer.

The invariant: a statement runs here only when it would send exactly the SQL and the parameters
SQLAlchemy's own path sends, and its rows need no processing SQLAlchemy would do. A shape is
compiled once (keyed by SQLAlchemy's cache key, as its compiled cache is) with the connection's
asyncpg dialect: the SQL with ``$n`` and the order of the bind names. Each call binds its own
values (``construct_params`` with the statement's extracted parameters, then the binds' type
processors, as ``DefaultExecutionContext`` does) and is sent as a prepared statement (as
SQLAlchemy's adapter sends it: one command, whatever its text holds) with ``fetch`` /
``execute``; a result column that holds SQL text (``literal_column("a, b")``) is first checked
against the driver's description, and a mismatch goes to SQLAlchemy's path, which names the
driver's columns. A result's keys are its shape's, plus (for another statement of the shape than
the one compiled) its own column objects, as SQLAlchemy adapts a cached compiled's keymap.

``plan`` answers ``None`` for anything else, and the caller takes SQLAlchemy's path: statements
that are not Core ``Select`` / ``Insert`` / ``Update`` / ``Delete`` (``text()``, ORM-enabled
statements, unions), statements with execution options, ``IN`` lists and literal-execute binds,
Python-side column defaults (prefetch) and implicit RETURNING (``inserted_primary_key``), result
columns of a type with a result processor (``Numeric``, ``Enum``, ``PickleType``, a
``TypeDecorator`` that converts results) or duplicate names, a ``*`` or ``text()`` result
column (SQLAlchemy matches those by the driver's names), a statement that does not compile.
A driver error is raised as SQLAlchemy raises it (its DBAPI translation, then
``DBAPIError.instance``), so the worker's classifier sees the same exception chain.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import asyncpg
import sqlalchemy.exc
from sqlalchemy import Delete, Insert, Select, Update
from sqlalchemy.engine import Dialect, IteratorResult
from sqlalchemy.engine.cursor import _NO_RESULT_METADATA
from sqlalchemy.engine.result import SimpleResultMetaData
from sqlalchemy.sql import sqltypes, visitors
from sqlalchemy.sql.compiler import WARN_LINTING, SQLCompiler
from sqlalchemy.sql.elements import ClauseElement, TextClause

MAX_PLANS = 2000
"""Statement shapes remembered (per process); past it the memory starts over."""

_FAST_STATEMENTS = (Select, Insert, Update, Delete)


@dataclass(frozen=True, slots=True)
class Plan:
    """A compiled statement shape: its driver SQL, the bind names in ``$n`` order, the binds'
    type processors, and its result's keys (``None``: it returns no rows, only a row count)
    with their metadata, shared by its results as SQLAlchemy shares a compiled statement's."""

    sql: str
    compiled: SQLCompiler
    positions: tuple[str, ...]
    processors: Mapping[str, Callable[[Any], Any]]
    keys: tuple[str, ...] | None
    metadata: SimpleResultMetaData
    extra: tuple[tuple[Any, ...], ...] = ()
    """Each result column's objects (as its metadata's ``extra``) in the statement compiled."""
    described: bool = False
    """True when its columns must be checked against the driver's description before it runs
    (a column holds text SQLAlchemy does not parse: ``literal_column("a, b")``)."""


_plans: dict[Any, Plan | None] = {}


def plan(statement: Any, parameters: Any, dialect: Dialect) -> tuple[Plan, Any] | None:
    """The plan of ``statement`` run with ``parameters`` (a mapping or None) and the statement's
    cache key (its extracted bind values), or None when it must take SQLAlchemy's path."""
    if not isinstance(statement, _FAST_STATEMENTS) or statement._propagate_attrs:
        return None  # not Core, or ORM-enabled (its plugin compiles and loads it)
    if statement._execution_options:
        return None
    if parameters is None:
        column_keys: tuple[str, ...] = ()
    elif isinstance(parameters, Mapping):
        column_keys = tuple(sorted(parameters))
    else:
        return None  # executemany
    cache_key = statement._generate_cache_key()
    if cache_key is None:
        return None
    key = (dialect, cache_key.key, column_keys)
    try:
        found = _plans[key]
    except KeyError:
        if len(_plans) >= MAX_PLANS:
            _plans.clear()
        found = _plans[key] = _compile(statement, cache_key, dialect, column_keys)
    return None if found is None else (found, cache_key)


def _compile(
    statement: Any, cache_key: Any, dialect: Dialect, column_keys: tuple[str, ...]
) -> Plan | None:
    """The plan of a statement shape, or None when running it here could differ from
    SQLAlchemy's own execution. It is compiled as ``Connection.execute`` compiles it (with its
    cache key, so that another statement of the shape can bind its own values, and linting)."""
    try:
        compiled = statement._compiler(
            dialect,
            cache_key=cache_key,
            column_keys=list(column_keys),
            for_executemany=False,
            linting=dialect.compiler_linting | WARN_LINTING,
        )
    except Exception:
        return None  # SQLAlchemy's path raises it as it does
    if not isinstance(compiled, SQLCompiler) or not compiled.positional:
        return None
    if compiled.positiontup is None or compiled.literal_execute_params:
        return None
    if compiled.post_compile_params or compiled.insert_prefetch or compiled.update_prefetch:
        return None
    if compiled.implicit_returning or compiled.has_out_parameters:
        return None
    processors = compiled._bind_processors
    if not all(callable(processor) for processor in processors.values()):
        return None  # a tuple's processors, one per element
    keys: tuple[str, ...] | None = None
    extra: tuple[tuple[Any, ...], ...] = ()
    described = False
    if isinstance(statement, Select) or compiled.effective_returning:
        if not _positional_columns(compiled):
            return None  # SQLAlchemy matches the driver's columns by name: a ``*``, text()
        entries = compiled._result_columns
        keys = tuple(entry.keyname for entry in entries)
        if len(set(keys)) != len(keys) or not all(_plain(e.type, dialect) for e in entries):
            return None
        extra = tuple(tuple(entry.objects) for entry in entries)
        described = any(_textual(obj) for entry in entries for obj in entry.objects)
    return Plan(
        sql=compiled.string,
        compiled=compiled,
        positions=tuple(compiled.positiontup),
        processors=cast(dict[str, Callable[[Any], Any]], dict(processors)),
        keys=keys,
        metadata=SimpleResultMetaData(keys or (), extra=extra),
        extra=extra,
        described=described,
    )


def _positional_columns(compiled: SQLCompiler) -> bool:
    """True when SQLAlchemy would take the result's columns one to one, in order, from the
    compiled statement (its ``CursorResultMetaData`` fast case), so long as the driver reports
    as many columns: not a ``*`` or a ``text()`` column, whose columns it names from the
    driver's description."""
    return bool(
        compiled._result_columns
        and compiled._ordered_columns
        and not compiled._textual_ordered_columns
        and not compiled._ad_hoc_textual
        and not compiled._loose_column_name_matching
    )


def _textual(column: Any) -> bool:
    """True when ``column`` may render as several columns: it holds SQL text (a literal
    column, ``text()``) or an element SQLAlchemy does not define (a ``@compiles`` construct)."""
    if not isinstance(column, ClauseElement):
        return False
    for element in visitors.iterate(column):
        if isinstance(element, TextClause) or getattr(element, "is_literal", False):
            return True
        if not type(element).__module__.startswith("sqlalchemy."):
            return True
    return False


def _plain(type_: Any, dialect: Dialect) -> bool:
    """True when SQLAlchemy returns the driver's value of a column of ``type_`` as it is."""
    if isinstance(type_, sqltypes.Numeric):
        return False  # its processing depends on the column's type code in the result
    try:
        return type_._cached_result_processor(dialect, None) is None
    except Exception:
        return False


def arguments(found: Plan, cache_key: Any, parameters: Mapping[str, Any] | None) -> list[Any]:
    """The positional values of one call, processed by the binds' types."""
    values = found.compiled.construct_params(
        parameters, extracted_parameters=cache_key.bindparams, escape_names=False
    )
    assert values is not None
    processors = found.processors
    return [
        processors[name](values[name]) if name in processors else values[name]
        for name in found.positions
    ]


class FastResult(IteratorResult[Any]):
    """The rows of a statement run here, behind SQLAlchemy's ``Result`` API, with ``rowcount``;
    a statement without rows is a closed result, as SQLAlchemy's is."""

    def __init__(
        self, found: Plan, rows: Sequence[Any], rowcount: int, statement: Any = None
    ) -> None:
        metadata = found.metadata if statement is None else _metadata(found, statement)
        super().__init__(metadata, iter(rows) if found.keys is not None else _NoRows())
        self.rowcount = rowcount
        self.returns_rows = found.keys is not None
        if found.keys is None:
            self._metadata = _NO_RESULT_METADATA


def _metadata(found: Plan, statement: Any) -> SimpleResultMetaData:
    """The result metadata of ``statement`` run with ``found``: the plan's, and when the plan
    was compiled from another statement of its shape, with this statement's own columns added
    (as SQLAlchemy's ``CursorResultMetaData._adapt_to_context`` adds them), so that
    ``row._mapping[column]`` finds a column of a subquery or label built at each call."""
    if found.keys is None or statement is found.compiled.statement:
        return found.metadata
    shared = found.metadata
    keymap = dict(shared._keymap)
    key_to_index = dict(shared._key_to_index)
    columns = statement._all_selected_columns
    for index, (name, column) in enumerate(zip(found.keys, columns, strict=False)):
        keymap[column] = shared._keymap[name]
        key_to_index[column] = index
    adapted = SimpleResultMetaData.__new__(SimpleResultMetaData)
    for kind in type(shared).__mro__:  # a copy (its slots), then the two maps replaced
        for slot in getattr(kind, "__slots__", ()):
            if hasattr(shared, slot):
                setattr(adapted, slot, getattr(shared, slot))
    adapted._keymap = keymap
    adapted._key_to_index = key_to_index
    return adapted


class _NoRows:
    """The rows of a statement that returns none: reading them raises as SQLAlchemy does."""

    def __iter__(self) -> _NoRows:
        return self

    def __next__(self) -> Any:
        _NO_RESULT_METADATA._we_dont_return_rows()


async def run(
    found: Plan, args: Sequence[Any], driver: asyncpg.Connection, statement: Any = None
) -> FastResult | None:
    """Send the statement with ``args`` on ``driver`` as SQLAlchemy's adapter sends it: a
    prepared statement (one command only, whatever its text holds); asyncpg's errors are raised
    as they are. None, with nothing executed (only prepared), when the driver describes other
    columns than the compiled statement's: then SQLAlchemy's path must name them."""
    if found.keys is not None and not found.described:
        records = await driver.fetch(found.sql, *args)  # its status counts the rows it returns
        return FastResult(found, [tuple(r) for r in records], len(records), statement)
    if found.keys is None and args:
        return FastResult(found, (), _rowcount(await driver.execute(found.sql, *args)))
    # without arguments asyncpg's execute() would send a simple query (several commands run)
    prepared = await driver._prepare(found.sql, use_cache=True)
    columns = 0 if found.keys is None else len(found.keys)
    if len(prepared.get_attributes()) != columns:
        return None
    records = await prepared.fetch(*args)
    rows: Sequence[Any] = [tuple(r) for r in records] if found.keys is not None else ()
    return FastResult(found, rows, _rowcount(prepared.get_statusmsg()), statement)


_ROWCOUNT = re.compile(r"(?:SELECT|UPDATE|DELETE|INSERT \d+) (\d+)")


def _rowcount(status: str | None) -> int:
    """The row count of a command status (``UPDATE 3``, ``INSERT 0 1``) as SQLAlchemy's asyncpg
    adapter reads it, -1 when it has none."""
    match = _ROWCOUNT.match(status or "")
    return int(match.group(1)) if match else -1


def as_sqlalchemy_error(
    error: Exception, found: Plan, args: Sequence[Any], dialect: Dialect, *, hide: bool
) -> Exception:
    """``error`` as SQLAlchemy's path raises it: asyncpg's exception translated to the
    adapter's DBAPI error (its cause), wrapped by ``DBAPIError.instance`` (``IntegrityError``,
    ``OperationalError`` …); an error the adapter does not translate is returned as it is."""
    dbapi = dialect.loaded_dbapi
    translations = dbapi._asyncpg_error_translate
    for kind in type(error).__mro__:
        if kind in translations:
            message = error.args[0] if error.args else str(error)
            dbapi_error = translations[kind](message, error)
            dbapi_error.__cause__ = error
            break
    else:
        return error
    wrapped: Exception = sqlalchemy.exc.DBAPIError.instance(
        found.sql,
        tuple(args),
        dbapi_error,
        dbapi.Error,
        hide_parameters=hide,
        dialect=dialect,
    )
    wrapped.__cause__ = dbapi_error
    return wrapped
