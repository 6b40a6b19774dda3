"""The one classifier of failures: what a later attempt may get past, and what it never will."""

from __future__ import annotations

from types import SimpleNamespace

import aiormq.exceptions
import asyncpg
import pytest

from tests.helpers import FAILOVER_ERRORS
from worker.errors import (
    Fault,
    HandlerFailed,
    Retryable,
    classify,
    is_transient,
    unusable_connection_is_a_disconnect,
)


class _SqlState(Exception):
    def __init__(self, sqlstate: str) -> None:
        super().__init__(sqlstate)
        self.sqlstate = sqlstate


def _caused_by(cause: BaseException) -> Exception:
    try:
        raise RuntimeError("wrapper") from cause
    except RuntimeError as exc:
        return exc


@pytest.mark.parametrize(
    "exc",
    [
        Retryable("try later"),
        TimeoutError(),
        ConnectionResetError(),
        aiormq.exceptions.ChannelInvalidStateError("channel closed"),
        _SqlState("40001"),
        _SqlState("40P01"),
        _SqlState("08006"),
        _caused_by(_SqlState("57P01")),
        # aiormq, opening a channel while a robust connection reconnects (found by the soak)
        RuntimeError('<Connection: "amqp://guest:******@localhost:5672/" at 0x7f> closed'),
        RuntimeError("<RobustChannel object at 0x7f> closed"),
        # refused credentials are not the message's fault (at start-up they are not retried:
        # see tests/integration/test_tls_and_auth.py)
        aiormq.exceptions.AuthenticationError("wrong password"),
        # aio-pika, a channel asked of a robust connection between reconnects (the soak again)
        RuntimeError("Connection was not opened"),
    ],
)
def test_outages_and_conflicts_are_transient(exc: BaseException) -> None:
    assert is_transient(exc)


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("bad amount"),
        HandlerFailed("boom"),
        _SqlState("23505"),  # unique violation
        _caused_by(KeyError("account")),
        RuntimeError("the ledger is closed"),
    ],
)
def test_bugs_and_bad_data_are_permanent(exc: BaseException) -> None:
    assert not is_transient(exc)


@pytest.mark.parametrize("exc", FAILOVER_ERRORS, ids=lambda exc: type(exc).__name__)
def test_no_primary_is_transient_never_the_messages_fault(exc: BaseException) -> None:
    assert classify(exc) is Fault.TRANSIENT


def test_a_connection_no_statement_can_use_is_dropped_from_the_pool() -> None:
    # Given the error SQLAlchemy's asyncpg adapter raises for a connection left mid-operation
    error = asyncpg.exceptions.InternalClientError(
        "cannot switch to state 15; another operation (2) is in progress"
    )
    context = SimpleNamespace(original_exception=_wrapped(error), is_disconnect=False)

    # When the engine's error hook sees it, it calls it a disconnect (the pool drops it)
    unusable_connection_is_a_disconnect(context)
    assert context.is_disconnect

    # And any other error is left as SQLAlchemy judged it
    other = SimpleNamespace(original_exception=ValueError("bad input"), is_disconnect=False)
    unusable_connection_is_a_disconnect(other)
    assert not other.is_disconnect


def _wrapped(cause: BaseException) -> BaseException:
    try:
        raise RuntimeError("the adapter's error") from cause
    except RuntimeError as exc:
        return exc
