"""``benchmarks.peer`` builds the peer's virtualenv only when allowed, says why it cannot, and
reads a process's CPU time; the peer itself runs in tests/integration/test_benchmarks.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from benchmarks import peer


def test_a_missing_venv_is_unavailable_with_its_reason_when_building_is_not_allowed(
    tmp_path: Path,
) -> None:
    venv = tmp_path / "venv-peer"
    with pytest.raises(peer.PeerUnavailable, match="venv-peer is not built"):
        peer.peer_python(venv, build=False)
    assert not venv.exists()


def test_a_venv_installed_from_other_requirements_is_not_taken_as_built(tmp_path: Path) -> None:
    venv = tmp_path / "venv-peer"
    venv.mkdir()
    (venv / peer.INSTALLED).write_text("faststream==0.0.1\n")
    with pytest.raises(peer.PeerUnavailable):
        peer.peer_python(venv, build=False)
    (venv / peer.INSTALLED).write_text(peer.REQUIREMENTS.read_text())
    assert peer.peer_python(venv, build=False) == venv / "bin" / "python"


def test_extra_arguments_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    names = peer.PeerNames("postgresql+asyncpg://db", "amqp://mq", "ex", "q", 400)
    monkeypatch.setenv(peer.EXTRA_ARGUMENTS, "--relay-workers 4")
    arguments = peer._arguments(names)
    assert arguments[-2:] == ["--relay-workers", "4"]
    assert "--prefetch=400" in arguments
    assert not any("postgresql" in a or "amqp" in a for a in arguments)  # URLs go by environment


def test_the_cpu_time_of_a_running_process_is_read() -> None:
    seconds = peer.cpu_seconds(os.getpid())
    assert seconds is None or seconds > 0
    assert peer.cpu_seconds(2**22 + 12345) is None
