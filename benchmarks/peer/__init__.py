"""Running the FastStream + faststream-outbox peer (``service.py``) in a virtualenv of its own.

The peer's libraries never enter the project's environment: ``peer_python`` builds
``.venv-peer`` at the repository root (gitignored) with ``python3 -m venv`` and ``pip install -r
benchmarks/peer/requirements.txt`` when it is missing or its requirements changed, and raises
``PeerUnavailable`` with the reason when that fails (no package index, say), so a benchmark
reports the peer as skipped instead of crashing. ``running_peer`` starts ``service.py`` with that
interpreter and yields once it printed ``ready``; it always stops the process it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import stop_process

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
VENV = ROOT / ".venv-peer"
REQUIREMENTS = HERE / "requirements.txt"
SERVICE = HERE / "service.py"
INSTALLED = "requirements.installed.txt"
"""The copy of ``REQUIREMENTS`` kept in the venv once installed: a venv without it, or with
another content, is rebuilt."""
INSTALL_SECONDS = 600.0
READY_SECONDS = 60.0
STOP_SECONDS = 30.0
EXTRA_ARGUMENTS = "BENCH_PEER_ARGS"
"""An environment variable of more ``service.py`` options, e.g. ``--relay-workers 4``, to
measure the peer tuned; unset, it runs on the libraries' defaults."""


class PeerUnavailable(Exception):
    """The peer's virtualenv could not be made; the message says why."""


@dataclass(frozen=True)
class PeerNames:
    """What the peer connects to and consumes: URLs, the exchange, its request queue."""

    database_url: str
    amqp_url: str
    exchange: str
    queue: str
    prefetch: int


def _installed(venv: Path) -> bool:
    marker = venv / INSTALLED
    return marker.exists() and marker.read_text() == REQUIREMENTS.read_text()


def _build(venv: Path, timeout: float) -> None:
    """Make ``venv`` from scratch and install the requirements; raise ``PeerUnavailable``."""
    shutil.rmtree(venv, ignore_errors=True)
    python = venv / "bin" / "python"
    steps = (
        [shutil.which("python3") or sys.executable, "-m", "venv", str(venv)],
        [str(python), "-m", "pip", "install", "-q", "-r", str(REQUIREMENTS)],
    )
    for step in steps:
        try:
            done = subprocess.run(
                step, capture_output=True, text=True, timeout=timeout, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            shutil.rmtree(venv, ignore_errors=True)
            raise PeerUnavailable(f"{' '.join(step[:4])}: {exc}") from exc
        if done.returncode != 0:
            shutil.rmtree(venv, ignore_errors=True)
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise PeerUnavailable(f"{' '.join(step[:4])} failed ({done.returncode}): {last}")
    (venv / INSTALLED).write_text(REQUIREMENTS.read_text())


def peer_python(venv: Path = VENV, *, build: bool = True, timeout: float = INSTALL_SECONDS) -> Path:
    """The interpreter of the peer's virtualenv, built first when needed and ``build`` (blocking:
    seconds to minutes, each step within ``timeout``). Raises ``PeerUnavailable`` with the
    reason when it is not there and cannot (or may not) be made."""
    if not _installed(venv):
        if not build:
            raise PeerUnavailable(f"{venv.name} is not built (a run without --quick builds it)")
        _build(venv, timeout)
    return venv / "bin" / "python"


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds process ``pid`` has used so far (Linux ``/proc``; else None)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _arguments(names: PeerNames) -> list[str]:
    """The command line; the URLs go by environment (``PEER_DATABASE_URL``, ``PEER_AMQP_URL``),
    where ``ps`` does not show their passwords."""
    return [
        f"--exchange={names.exchange}",
        f"--queue={names.queue}",
        f"--prefetch={names.prefetch}",
        "--reset",
        *shlex.split(os.environ.get(EXTRA_ARGUMENTS, "")),
    ]


async def _until_ready(process: asyncio.subprocess.Process, log: Path) -> None:
    """Return when the peer printed ``ready``; raise with its log's end if it ends first."""
    assert process.stdout is not None
    async with asyncio.timeout(READY_SECONDS):
        while line := await process.stdout.readline():
            if line.strip() == b"ready":
                return
    await process.wait()
    raise RuntimeError(f"the peer ended before it was ready ({process.returncode}):\n{_tail(log)}")


def _tail(log: Path, lines: int = 20) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


@contextlib.asynccontextmanager
async def running_peer(python: Path, names: PeerNames) -> AsyncIterator[asyncio.subprocess.Process]:
    """The peer service running on ``names``, from its ``ready`` line until the block ends;
    its log (stderr) goes to a temporary file, quoted when it fails to start."""
    with tempfile.TemporaryDirectory(prefix="peer-") as scratch:
        log = Path(scratch) / "peer.log"
        with log.open("wb") as errors:
            process = await asyncio.create_subprocess_exec(
                str(python),
                str(SERVICE),
                *_arguments(names),
                stdout=asyncio.subprocess.PIPE,
                stderr=errors,
                cwd=ROOT,
                env={
                    **os.environ,
                    "PEER_DATABASE_URL": names.database_url,
                    "PEER_AMQP_URL": names.amqp_url,
                },
            )
        try:
            await _until_ready(process, log)
            yield process
        finally:
            await stop_process(process, STOP_SECONDS)
