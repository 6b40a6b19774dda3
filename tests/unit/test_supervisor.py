"""The supervisor of ``worker run --processes N``: its restart policy as a table, the children's
ports and command line, and its machinery (forwarding, restarts, escalation, giving up) driven
with tiny ``python -c`` children, which need no service."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from tests.helpers import WORKER_SCRIPT, run, wait_until
from worker.errors import ConfigurationError
from worker.ops.cli import build_parser, load_settings
from worker.ops.supervisor import (
    SUPERVISOR_FD_ENV,
    GiveUp,
    Restart,
    RestartPolicy,
    Supervisor,
    after_death,
    child_command,
    child_ports,
    describe_exit,
    stop_when_orphaned,
)
from worker.settings import Settings

POLICY = RestartPolicy()
KILLED = -signal.SIGKILL


@pytest.mark.parametrize(
    ("returncode", "ran_for", "quick_deaths", "expected"),
    [
        # a first death: 1 s
        (KILLED, 0.5, 0, Restart(1.0, 1)),
        (1, 10.0, 0, Restart(1.0, 1)),
        # quick deaths in a row double the delay
        (1, 0.5, 1, Restart(2.0, 2)),
        (1, 0.5, 2, Restart(4.0, 3)),
        (KILLED, 59.9, 4, Restart(16.0, 5)),
        # the sixth in a row gives up
        (1, 0.5, 5, GiveUp(1, "it died 6 times in a row, each time within 1m of its start")),
        # a healthy run (a minute or more) forgives the earlier deaths
        (1, 60.0, 5, Restart(1.0, 1)),
        (KILLED, 3600.0, 4, Restart(1.0, 1)),
        # an exit 0 the supervisor did not ask for is restarted like any other
        (0, 0.5, 0, Restart(1.0, 1)),
        # a configuration error stops everything at once, whatever came before
        (2, 0.5, 0, GiveUp(2, "a configuration error, which no restart can fix")),
        (2, 3600.0, 3, GiveUp(2, "a configuration error, which no restart can fix")),
    ],
)
def test_after_death(
    returncode: int, ran_for: float, quick_deaths: int, expected: Restart | GiveUp
) -> None:
    assert after_death(POLICY, returncode, ran_for, quick_deaths) == expected


def test_the_delay_stops_doubling_at_its_maximum() -> None:
    patient = RestartPolicy(quick_deaths=10)
    delays = [after_death(patient, 1, 0.1, n) for n in range(8)]
    assert [d.delay for d in delays if isinstance(d, Restart)] == [1, 2, 4, 8, 16, 30, 30, 30]


@pytest.mark.parametrize(
    ("returncode", "text"),
    [
        (0, "exited 0"),
        (1, "exited 1"),
        (-9, "was killed by SIGKILL"),
        (-15, "was killed by SIGTERM"),
    ],
)
def test_describe_exit(returncode: int, text: str) -> None:
    assert describe_exit(returncode) == text


def test_worker_i_serves_its_endpoint_on_http_port_plus_i() -> None:
    settings = Settings.load({}, processes=3, http_port=9180)
    assert child_ports(settings) == [9180, 9181, 9182]


def test_no_endpoint_stays_no_endpoint() -> None:
    assert child_ports(Settings.load({}, processes=3, http_port=0)) == [0, 0, 0]


def test_ports_past_65535_are_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="would need ports up to 65536"):
        child_ports(Settings.load({}, processes=3, http_port=65534))


def test_a_child_runs_one_process_on_its_own_port_whatever_came_before() -> None:
    argv = ["run", "--processes", "4", "--http-port=9000", "--handlers", "examples.payments"]
    command = child_command(argv, 9003)
    assert command[:3] == [sys.executable, "-m", "worker"]
    args = build_parser().parse_args(command[3:])
    assert (args.processes, args.http_port, args.handlers) == (1, 9003, ("examples.payments",))


def test_processes_defaults_to_1_and_must_be_positive() -> None:
    assert Settings.load({}).processes == 1
    assert Settings.load({"WORKER_PROCESSES": "4"}).processes == 4
    result = run(WORKER_SCRIPT, "run", "--processes", "0")
    assert result.returncode == 2
    assert "--processes" in result.stderr
    assert "Traceback" not in result.stderr


def test_processes_is_a_setting_of_run_only() -> None:
    result = run(WORKER_SCRIPT, "relay", "--processes", "2")
    assert result.returncode == 2
    assert "--processes is not a setting of 'relay' (it is read by: run)" in result.stderr


def test_the_supervisor_refuses_ports_past_65535_before_starting_anything() -> None:
    result = run(WORKER_SCRIPT, "run", "--processes", "3", "--http-port", "65534")
    assert result.returncode == 2
    assert "would need ports up to 65536" in result.stderr


# The machinery, with children that need no service

FAST = RestartPolicy(first_delay=0.01, max_delay=0.05, healthy_after=60.0, quick_deaths=2)
STOP_TIMEOUT = 10.0


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def until_stopped_then_exit(code: int, ready: Path) -> list[str]:
    """A child that writes its pid to ``ready``, then exits ``code`` on SIGTERM or SIGINT."""
    return python(
        "import os, signal, sys, time\n"
        f"signal.signal(signal.SIGTERM, lambda *_: sys.exit({code}))\n"
        f"signal.signal(signal.SIGINT, lambda *_: sys.exit({code}))\n"
        f"open({str(ready)!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
        "while True: time.sleep(1)\n"
    )


def ignoring_sigterm(ready: Path) -> list[str]:
    return python(
        "import os, signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"open({str(ready)!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
        "while True: time.sleep(1)\n"
    )


async def started(ready: Path, count: int) -> list[int]:
    """The pids the children wrote to ``ready``, once there are ``count``."""

    async def written() -> bool:
        return len(_pids(ready)) >= count

    await wait_until(written, timeout=10, interval=0.01)
    return _pids(ready)


def _pids(ready: Path) -> list[int]:
    return [int(line) for line in ready.read_text().split()] if ready.exists() else []


async def test_a_stop_is_forwarded_to_every_child_and_clean_exits_give_0(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    supervisor = Supervisor([until_stopped_then_exit(0, ready)] * 2, stop_timeout=STOP_TIMEOUT)
    running = asyncio.create_task(supervisor.run())
    await started(ready, 2)

    supervisor.signalled(signal.SIGTERM)

    assert await asyncio.wait_for(running, STOP_TIMEOUT) == 0


async def test_a_child_that_stops_uncleanly_makes_the_exit_status_1(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    commands = [until_stopped_then_exit(0, ready), until_stopped_then_exit(3, ready)]
    supervisor = Supervisor(commands, stop_timeout=STOP_TIMEOUT)
    running = asyncio.create_task(supervisor.run())
    await started(ready, 2)

    supervisor.signalled(signal.SIGINT)

    assert await asyncio.wait_for(running, STOP_TIMEOUT) == 1


async def test_a_killed_child_is_restarted(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    supervisor = Supervisor(
        [until_stopped_then_exit(0, ready)] * 2, stop_timeout=STOP_TIMEOUT, policy=FAST
    )
    running = asyncio.create_task(supervisor.run())
    first, second = await started(ready, 2)

    os.kill(first, signal.SIGKILL)
    *_, restarted = await started(ready, 3)

    assert restarted not in (first, second)
    assert supervisor.children[0].quick_deaths + supervisor.children[1].quick_deaths == 1
    supervisor.signalled(signal.SIGTERM)
    assert await asyncio.wait_for(running, STOP_TIMEOUT) == 0


async def test_a_child_that_keeps_dying_makes_the_supervisor_stop_the_others_and_exit_1(
    tmp_path: Path,
) -> None:
    ready = tmp_path / "ready"
    commands = [until_stopped_then_exit(0, ready), python("raise SystemExit(1)")]
    supervisor = Supervisor(commands, stop_timeout=STOP_TIMEOUT, policy=FAST)

    status = await asyncio.wait_for(supervisor.run(), STOP_TIMEOUT)

    assert status == 1
    assert supervisor.children[1].quick_deaths == FAST.quick_deaths
    assert len(_pids(ready)) <= 1  # the healthy one was stopped, not restarted


async def test_an_exit_2_stops_everything_at_once_with_2(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    commands = [until_stopped_then_exit(0, ready), python("raise SystemExit(2)")]
    supervisor = Supervisor(commands, stop_timeout=STOP_TIMEOUT, policy=FAST)

    assert await asyncio.wait_for(supervisor.run(), STOP_TIMEOUT) == 2
    assert supervisor.children[1].quick_deaths == 0


async def test_a_second_signal_kills_children_that_do_not_stop(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    supervisor = Supervisor([ignoring_sigterm(ready)] * 2, stop_timeout=STOP_TIMEOUT)
    running = asyncio.create_task(supervisor.run())
    await started(ready, 2)

    supervisor.signalled(signal.SIGTERM)  # ignored by the children
    supervisor.signalled(signal.SIGINT)

    assert await asyncio.wait_for(running, STOP_TIMEOUT) == 1


async def test_children_that_outlive_the_stop_timeout_are_killed(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    supervisor = Supervisor([ignoring_sigterm(ready)], stop_timeout=0.5)
    running = asyncio.create_task(supervisor.run())
    await started(ready, 1)

    supervisor.signalled(signal.SIGTERM)

    assert await asyncio.wait_for(running, STOP_TIMEOUT) == 1


async def test_a_stop_before_any_child_started_starts_none(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    supervisor = Supervisor([until_stopped_then_exit(0, ready)] * 2, stop_timeout=STOP_TIMEOUT)
    supervisor.stop(signal.SIGTERM)

    assert await asyncio.wait_for(supervisor.run(), STOP_TIMEOUT) == 0
    assert _pids(ready) == []


def test_a_child_runs_one_process_when_the_environment_asks_for_more(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("WORKER_PROCESSES", "4")
    args = build_parser().parse_args(child_command(["run"], 0)[3:])
    assert load_settings(args).processes == 1


# A child's side: stopping once the supervisor is gone


async def test_a_child_stops_when_the_supervisors_end_of_the_pipe_closes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    watched, held = os.pipe()
    try:
        monkeypatch.setenv(SUPERVISOR_FD_ENV, str(watched))
        stop = asyncio.Event()
        stop_when_orphaned(stop)
        await asyncio.sleep(0)
        assert not stop.is_set()

        os.close(held)  # as the kernel does when the supervisor dies

        await asyncio.wait_for(stop.wait(), 5)
    finally:
        os.close(watched)


async def test_a_process_no_supervisor_started_watches_nothing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    stop = asyncio.Event()
    monkeypatch.delenv(SUPERVISOR_FD_ENV, raising=False)
    stop_when_orphaned(stop)
    monkeypatch.setenv(SUPERVISOR_FD_ENV, "not a number")
    stop_when_orphaned(stop)
    await asyncio.sleep(0)
    assert not stop.is_set()
    assert "is not a pipe of a supervisor's" in caplog.text
