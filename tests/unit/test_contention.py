"""The contention registry: a handler's batches take turns for ``hold`` seconds after its last
deadlock, and only that handler's."""

from __future__ import annotations

from worker.core.contention import Contention
from worker.errors import Retryable, is_contention


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SQLStateError(Exception):
    def __init__(self, sqlstate: str) -> None:
        super().__init__(sqlstate)
        self.sqlstate = sqlstate


def test_a_deadlock_makes_that_handler_take_turns_for_a_while() -> None:
    clock = Clock()
    contention = Contention(hold=10.0, clock=clock)
    assert not contention.contended("a")
    contention.deadlocked("a")
    assert contention.contended("a")
    assert not contention.contended("b")
    clock.now = 9.9
    assert contention.contended("a")
    contention.deadlocked("a")  # a later deadlock extends the hold
    clock.now = 15.0
    assert contention.contended("a")
    clock.now = 20.0
    assert not contention.contended("a")


def test_deadlocks_and_serialization_failures_are_contention_other_errors_are_not() -> None:
    assert is_contention(SQLStateError("40P01"))
    assert is_contention(SQLStateError("40001"))
    wrapped = Retryable("retry")
    wrapped.__cause__ = SQLStateError("40P01")
    assert is_contention(wrapped)
    assert not is_contention(SQLStateError("23505"))
    assert not is_contention(ValueError("boom"))
