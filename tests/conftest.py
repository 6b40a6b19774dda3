"""Markers by folder: ``tests/unit`` needs no services, ``tests/integration`` the real
PostgreSQL and RabbitMQ. ``-m unit`` runs in seconds on any machine."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        folder = item.path.relative_to(HERE).parts[0]
        if folder in ("unit", "integration"):
            item.add_marker(folder)
