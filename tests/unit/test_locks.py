"""The advisory lock classes: one first key per kind of lock."""

from __future__ import annotations

from worker.sql import locks


def test_every_kind_of_advisory_lock_has_a_first_key_of_its_own() -> None:
    declared = {
        name: value
        for name, value in vars(locks).items()
        if name.isupper() and isinstance(value, int)
    }
    assert sorted(declared.values()) == sorted(locks.CLASSES)
    assert len(set(locks.CLASSES)) == len(locks.CLASSES)
