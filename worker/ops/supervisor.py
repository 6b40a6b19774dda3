"""``worker run --processes N``: a supervisor that keeps N worker processes consuming the same
queue and outbox, and stops them together.

Invariant: the supervisor leaves no worker process behind and never runs short quietly. It
returns only once every child it started has exited (and been reaped); a child that dies is
restarted with backoff, and when one keeps dying, or exits with a configuration error, all are
stopped and the exit status says why. Each child also watches a pipe whose only writer is the
supervisor and stops (drains, as on SIGTERM) when that pipe closes, however the supervisor ended,
SIGKILL included.

A child is a fresh interpreter, ``python -m worker`` with the supervisor's own arguments followed
by ``--processes=1 --http-port=<port>`` (argparse keeps a flag's last value): it inherits no event
loop, no socket and no imported handler module, and it is exactly the single-process
``worker run``, whose exit status 2 means a configuration error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import stat
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from worker.errors import ConfigurationError
from worker.settings import Settings, format_duration

log = logging.getLogger(__name__)

SUPERVISOR_FD_ENV = "WORKER_SUPERVISOR_FD"
"""Set in a child: the read end of a pipe that reaches end-of-file once the supervisor is gone."""

CONFIGURATION_ERROR = 2
"""The exit status of a ``worker`` command (a child's, the supervisor's) refused its settings."""

GAVE_UP = 1
"""The supervisor's exit status when it stopped its children for any other fault."""

KILL_MARGIN = 10.0
"""Seconds beyond ``shutdown_grace`` that stopping children get before they are SIGKILLed."""

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

MAX_PORT = 65535


@dataclass(frozen=True)
class RestartPolicy:
    """When a dead child starts again, and when the supervisor gives up.

    A death less than ``healthy_after`` seconds after the child started is a quick death. The
    n-th quick death in a row waits ``first_delay`` times 2 ** (n - 1) seconds, at most
    ``max_delay``, before the restart; one more than ``quick_deaths`` in a row gives up. A death
    after a healthy run starts a new count at 1.
    """

    first_delay: float = 1.0
    max_delay: float = 30.0
    healthy_after: float = 60.0
    quick_deaths: int = 5

    def delay(self, quick_deaths: int) -> float:
        """Seconds before the restart that follows the ``quick_deaths``-th quick death in a row."""
        return min(self.first_delay * 2.0 ** (quick_deaths - 1), self.max_delay)

    def describe(self) -> str:
        """The policy in a sentence, for ``worker run --help``."""
        delays = ", ".join(format_duration(self.delay(n)) for n in range(1, self.quick_deaths + 1))
        return (
            f"restarts a worker process that dies, after {delays} for its quick deaths in a row "
            f"(within {format_duration(self.healthy_after)} of its start), and stops them all "
            f"(exit 1) at its quick death {self.quick_deaths + 1} in a row, or at once (exit 2) "
            "when one exits 2, a configuration error"
        )


@dataclass(frozen=True)
class Restart:
    """Start the child again in ``delay`` seconds; it has died ``quick_deaths`` times in a row."""

    delay: float
    quick_deaths: int


@dataclass(frozen=True)
class GiveUp:
    """Stop every child and exit with ``exit_status``, because of ``reason``."""

    exit_status: int
    reason: str


def after_death(
    policy: RestartPolicy, returncode: int, ran_for: float, quick_deaths: int
) -> Restart | GiveUp:
    """What follows a child's unexpected exit with ``returncode`` (negative: the signal that
    killed it), ``ran_for`` seconds after it started, when it had died ``quick_deaths`` times
    in a row before."""
    if returncode == CONFIGURATION_ERROR:
        return GiveUp(CONFIGURATION_ERROR, "a configuration error, which no restart can fix")
    count = 1 if ran_for >= policy.healthy_after else quick_deaths + 1
    if count > policy.quick_deaths:
        return GiveUp(
            GAVE_UP,
            f"it died {count} times in a row, each time within "
            f"{format_duration(policy.healthy_after)} of its start",
        )
    return Restart(policy.delay(count), count)


def describe_exit(returncode: int) -> str:
    """``exited 1``, or ``was killed by SIGKILL``."""
    if returncode >= 0:
        return f"exited {returncode}"
    try:
        return f"was killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"was killed by signal {-returncode}"


def child_port(http_port: int, index: int) -> int:
    """The ``/healthz`` and ``/metrics`` port of child ``index``: ``http_port`` + index, or
    none (0) when ``http_port`` is 0."""
    return http_port + index if http_port else 0


def child_ports(settings: Settings) -> list[int]:
    """Each child's endpoint port; a ``ConfigurationError`` when the last is past 65535."""
    ports = [child_port(settings.http_port, index) for index in range(settings.processes)]
    if ports[-1] > MAX_PORT:
        raise ConfigurationError(
            f"processes ({settings.processes}) from http_port ({settings.http_port}) would need "
            f"ports up to {ports[-1]}: lower http_port, or 0 for no endpoint"
        )
    return ports


def child_command(argv: Sequence[str], http_port: int) -> list[str]:
    """A child's command line: the supervisor's ``worker`` arguments, then a single process
    serving its endpoint on ``http_port`` (these last flags win over any before them)."""
    return [sys.executable, "-m", "worker", *argv, "--processes=1", f"--http-port={http_port}"]


@dataclass
class _Child:
    """One of the N places: its command, its current process, its quick deaths in a row."""

    index: int
    command: list[str]
    process: asyncio.subprocess.Process | None = None
    quick_deaths: int = 0

    @property
    def name(self) -> str:
        return f"worker {self.index}"

    @property
    def running(self) -> asyncio.subprocess.Process | None:
        process = self.process
        return process if process is not None and process.returncode is None else None


class Supervisor:
    """Runs one child per command until ``stop``, then gives them ``stop_timeout`` seconds to
    exit before it kills them; ``run`` returns the exit status.

    0: stopped by a signal and every child stopped cleanly (exit 0, or killed by the forwarded
    signal before it had installed its handler); 2: a child exited 2 (configuration error);
    1: anything else (a child kept dying, failed to stop in time, or was killed by a second
    signal).
    """

    def __init__(
        self,
        commands: Sequence[Sequence[str]],
        *,
        stop_timeout: float,
        policy: RestartPolicy | None = None,
    ) -> None:
        self.children = [_Child(index, list(command)) for index, command in enumerate(commands)]
        self.stop_timeout = stop_timeout
        self.policy = policy or RestartPolicy()
        self._stopping = asyncio.Event()
        self._signal = signal.SIGTERM
        self._exit_status = 0
        self._clean = True

    def stop(self, sig: signal.Signals = signal.SIGTERM, exit_status: int = 0) -> None:
        """Forward ``sig`` to every running child and restart none; once only."""
        if self._stopping.is_set():
            return
        self._signal, self._exit_status = sig, exit_status
        self._stopping.set()
        for child in self.children:
            self._send(child, sig)

    def signalled(self, sig: signal.Signals) -> None:
        """SIGTERM/SIGINT to the supervisor: the first stops the children gracefully (each drains
        within its own ``shutdown_grace``); another one while they stop kills them."""
        if not self._stopping.is_set():
            log.info(
                "%s: forwarded to the worker processes, killed if still running in %s",
                sig.name,
                format_duration(self.stop_timeout),
            )
            self.stop(sig)
        else:
            self.kill(f"{sig.name} while stopping")

    def kill(self, why: str) -> None:
        """SIGKILL every running child: their transactions roll back, their unacked deliveries
        go back to the queue."""
        self._clean = False
        for child in self.children:
            if (process := child.running) is not None:
                log.error("%s: killing %s (pid %d)", why, child.name, process.pid)
                process.kill()

    async def run(self) -> int:
        """Start every child, keep them running until stopped, wait for all to exit."""
        watched, held = os.pipe()  # the children get ``watched``; ``held`` closes with us
        try:
            tasks = [
                asyncio.create_task(self._keep_running(child, watched), name=child.name)
                for child in self.children
            ]
            await self._stopping.wait()
            _, late = await asyncio.wait(tasks, timeout=self.stop_timeout)
            if late:
                self.kill(f"not stopped within {format_duration(self.stop_timeout)}")
                await asyncio.wait(late)
        finally:
            os.close(held)
            os.close(watched)
        status = max(self._exit_status, 0 if self._clean else GAVE_UP)
        log.info("all worker processes have exited; supervisor exits %d", status)
        return status

    async def _keep_running(self, child: _Child, watched: int) -> None:
        """Run ``child`` until stopping, restarting it after each unexpected exit."""
        loop = asyncio.get_running_loop()
        try:
            while not self._stopping.is_set():
                process = await self._start(child, watched)
                started = loop.time()
                returncode = await process.wait()
                if self._stopping.is_set():
                    self._stopped(child, process.pid, returncode)
                    return
                delay = self._restart_delay(child, process.pid, returncode, loop.time() - started)
                if delay is None:
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), delay)
        except Exception as exc:
            log.critical("%s: %s; stopping the others", child.name, exc, exc_info=exc)
            self._clean = False
            self.stop(exit_status=GAVE_UP)

    def _restart_delay(
        self, child: _Child, pid: int, returncode: int, ran_for: float
    ) -> float | None:
        """After ``child``'s unexpected exit: the wait before its restart, or None when the
        policy gives up (then every child is being stopped)."""
        decision = after_death(self.policy, returncode, ran_for, child.quick_deaths)
        died = f"{child.name} (pid {pid}) {describe_exit(returncode)}"
        if isinstance(decision, GiveUp):
            log.critical("%s: %s; stopping the others", died, decision.reason)
            self.stop(exit_status=decision.exit_status)
            return None
        child.quick_deaths = decision.quick_deaths
        log.error(
            "%s after %.1f s; restarting it in %s (quick deaths in a row: %d; %d give up)",
            died,
            ran_for,
            format_duration(decision.delay),
            decision.quick_deaths,
            self.policy.quick_deaths + 1,
        )
        return decision.delay

    async def _start(self, child: _Child, watched: int) -> asyncio.subprocess.Process:
        child.process = await asyncio.create_subprocess_exec(
            *child.command,
            env={**os.environ, SUPERVISOR_FD_ENV: str(watched)},
            pass_fds=(watched,),
        )
        log.info("%s started (pid %d)", child.name, child.process.pid)
        if self._stopping.is_set():  # (stopped while it was being started)
            self._send(child, self._signal)
        return child.process

    def _stopped(self, child: _Child, pid: int, returncode: int) -> None:
        if returncode not in (0, -self._signal):
            self._clean = False
        log.info("%s (pid %d) stopped: %s", child.name, pid, describe_exit(returncode))

    @staticmethod
    def _send(child: _Child, sig: signal.Signals) -> None:
        if (process := child.running) is not None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(sig)


@contextlib.contextmanager
def _forwarding_signals(supervisor: Supervisor) -> Iterator[None]:
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, supervisor.signalled, sig)
    try:
        yield
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)


async def _supervise(commands: Sequence[Sequence[str]], stop_timeout: float) -> int:
    supervisor = Supervisor(commands, stop_timeout=stop_timeout)
    with _forwarding_signals(supervisor):
        return await supervisor.run()


def run_processes(settings: Settings, argv: Sequence[str]) -> int:
    """``worker run`` with ``settings.processes`` above 1: supervise that many children, each
    ``worker`` with ``argv`` as one process, until SIGTERM/SIGINT; the exit status."""
    ports = child_ports(settings)
    log.info(
        "supervisor (pid %d) starting %d worker processes on queue %s; %s",
        os.getpid(),
        settings.processes,
        settings.queue,
        f"worker i serves /healthz and /metrics on {settings.http_host}:{ports[0]} + i"
        if settings.http_port
        else "no /healthz or /metrics (http_port is 0)",
    )
    commands = [child_command(argv, port) for port in ports]
    return asyncio.run(_supervise(commands, settings.shutdown_grace + KILL_MARGIN))


def stop_when_orphaned(stop: asyncio.Event) -> None:
    """In a child of a supervisor, set ``stop`` once the supervisor is gone (its end of the pipe
    closed: it exited or was killed); elsewhere, nothing. Call it inside the running loop."""
    raw = os.environ.get(SUPERVISOR_FD_ENV)
    if raw is None:
        return
    try:
        watched = int(raw)
        is_pipe = stat.S_ISFIFO(os.fstat(watched).st_mode)
    except (ValueError, OSError):
        is_pipe = False
    if not is_pipe:
        log.warning("%s=%r is not a pipe of a supervisor's: not watched", SUPERVISOR_FD_ENV, raw)
        return
    loop = asyncio.get_running_loop()

    def orphaned() -> None:  # readable: end of file, since the supervisor never writes
        loop.remove_reader(watched)
        log.warning("the supervisor is gone: stopping")
        stop.set()

    loop.add_reader(watched, orphaned)
