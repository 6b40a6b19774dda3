"""``worker run --processes 2`` as an operator runs it, with the payments example: two worker
processes share the queue, each payment is applied once, a killed one is restarted and loses
nothing, SIGTERM stops them all with exit 0, a configuration error stops them with exit 2, and a
killed supervisor leaves no worker process behind."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import aio_pika
import pytest
from aio_pika.abc import AbstractRobustConnection
from sqlalchemy.ext.asyncio import AsyncEngine

from examples.payments.demo import DemoPlan, plan_payments, request_message
from tests.helpers import rows, scalar, wait_until
from tests.integration.support import ROOT, request, start_worker
from worker.ops.supervisor import RestartPolicy, Supervisor, child_command
from worker.settings import Settings

PROCESSES = 2
STOP_TIMEOUT = 30.0


def start_supervisor(
    settings: Settings, log: Path, *args: str, **env_vars: str
) -> subprocess.Popen[bytes]:
    """``python -m worker run --processes 2 *args`` with the payments example; output to ``log``."""
    return start_worker(
        settings,
        log,
        "run",
        args=("--processes", str(PROCESSES), *args),
        **{"WORKER_HANDLERS": "examples.payments", **env_vars},
    )


@contextlib.contextmanager
def supervised(
    settings: Settings, log: Path, *args: str, **env_vars: str
) -> Iterator[subprocess.Popen[bytes]]:
    """``start_supervisor``; on exit, whatever it left running is killed, children first."""
    supervisor = start_supervisor(settings, log, *args, **env_vars)
    try:
        yield supervisor
    finally:
        for pid in children_of(supervisor.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if supervisor.poll() is None:
            supervisor.kill()
            supervisor.wait()


def output_of(log: Path) -> str:
    """What the supervisor and its worker processes wrote so far."""
    return log.read_text(errors="replace")


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state, ppid, ...), or None
    once the process is gone or a zombie: an orphan's zombie waits for a PID 1 that may never
    reap it, but it runs nothing and holds no connection."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields


def alive(pid: int) -> bool:
    return _stat(pid) is not None


def children_of(pid: int) -> set[int]:
    """The live processes whose parent is ``pid``."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))) and int(fields[1]) == pid:
            found.add(int(entry.name))
    return found


async def consumers(amqp: AbstractRobustConnection, queue: str) -> int:
    """Consumers of ``queue`` now, as the broker counts them (0 before it is declared)."""
    channel = await amqp.channel()
    try:
        declared = await channel.declare_queue(queue, passive=True)
    except aio_pika.exceptions.ChannelClosed:
        return 0
    finally:
        if not channel.is_closed:
            await channel.close()
    return int(declared.declaration_result.consumer_count or 0)


async def until_consumers(amqp: AbstractRobustConnection, queue: str, count: int) -> None:
    async def reached() -> bool:
        return await consumers(amqp, queue) == count

    await wait_until(reached, timeout=60)


async def until_workers(supervisor: subprocess.Popen[bytes], count: int) -> set[int]:
    """The supervisor's worker processes, once it has ``count`` of them."""

    async def started() -> bool:
        return len(children_of(supervisor.pid)) == count

    await wait_until(started, timeout=30)
    return children_of(supervisor.pid)


async def publish_plan(amqp: AbstractRobustConnection, settings: Settings, plan: DemoPlan) -> None:
    channel = await amqp.channel(publisher_confirms=True)
    try:
        exchange = await channel.get_exchange(settings.exchange)
        for payment in plan.sends:
            await exchange.publish(request_message(payment), "payment.requested", mandatory=True)
    finally:
        await channel.close()


async def balances(engine: AsyncEngine) -> dict[str, int]:
    found = await rows(engine, "SELECT account, balance_cents FROM accounts")
    return {str(account): int(cents) for account, cents in found}


async def until_applied_once(engine: AsyncEngine, plan: DemoPlan) -> None:
    """Every payment of ``plan`` applied: a ledger row each and the balances they sum to (a
    payment applied twice would make a balance too high, and it would never come down)."""

    async def applied() -> bool:
        return await balances(engine) == plan.expected_balances

    await wait_until(applied, timeout=60)
    assert await scalar(engine, "SELECT count(*) FROM ledger_entries") == len(plan.payments)


async def stop(supervisor: subprocess.Popen[bytes], workers: set[int], log: Path) -> None:
    """SIGTERM to the supervisor: it exits 0 and no worker process is left."""
    supervisor.send_signal(signal.SIGTERM)
    await asyncio.to_thread(supervisor.wait, STOP_TIMEOUT)
    output = output_of(log)
    assert supervisor.returncode == 0, output
    assert not [pid for pid in workers if alive(pid)], output
    assert output.count("stopped: exited 0") == PROCESSES, output


def free_port_pair() -> int:
    """A port ``p`` such that ``p`` and ``p + 1`` were both free just now."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        with contextlib.suppress(OSError), socket.socket() as neighbour:
            neighbour.bind(("127.0.0.1", port + 1))
            return port
    raise AssertionError("no two neighbouring free ports")


async def healthy(port: int) -> bool:
    try:
        return (await request(port, "/healthz")).status == 200
    except OSError:
        return False


async def test_two_processes_share_the_queue_apply_each_payment_once_and_stop_on_sigterm(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection, tmp_path: Path
) -> None:
    log = tmp_path / "worker.log"
    port = free_port_pair()
    # Given `worker run --processes 2`, its endpoint asked on a port of our choosing
    with supervised(settings, log, "--http-port", str(port)) as supervisor:
        workers = await until_workers(supervisor, PROCESSES)
        # Then both consume the work queue, and each serves /healthz on its own port
        await until_consumers(amqp, settings.queue, PROCESSES)
        for own_port in (port, port + 1):
            await wait_until(functools.partial(healthy, own_port), timeout=30)

        # When payments arrive, a fifth of them twice
        plan = plan_payments(400, 0.2, accounts=5, seed=11)
        await publish_plan(amqp, settings, plan)

        # Then each is applied exactly once
        await until_applied_once(engine, plan)
        # and SIGTERM stops both processes and the supervisor with exit 0
        await stop(supervisor, workers, log)
    assert await consumers(amqp, settings.queue) == 0


async def test_a_killed_worker_process_is_restarted_and_nothing_is_lost_or_applied_twice(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection, tmp_path: Path
) -> None:
    log = tmp_path / "worker.log"
    with supervised(settings, log) as supervisor:
        workers = await until_workers(supervisor, PROCESSES)
        await until_consumers(amqp, settings.queue, PROCESSES)
        plan = plan_payments(2000, 0.2, accounts=5, seed=12)
        publishing = asyncio.create_task(publish_plan(amqp, settings, plan))

        # When one worker process is killed while the payments arrive and are applied
        async def started_applying() -> bool:
            return bool(await scalar(engine, "SELECT count(*) FROM ledger_entries"))

        await wait_until(started_applying)
        victim = min(workers)
        os.kill(victim, signal.SIGKILL)
        await publishing

        # Then the supervisor starts another in its place, which consumes too
        async def replaced() -> bool:
            now = children_of(supervisor.pid)
            return victim not in now and len(now) == PROCESSES

        await wait_until(replaced, timeout=30)
        await until_consumers(amqp, settings.queue, PROCESSES)
        assert f"(pid {victim}) was killed by SIGKILL" in output_of(log)
        # and every payment is applied exactly once: the victim's uncommitted batches roll
        # back and are redelivered, its committed ones are duplicates if they come again
        await until_applied_once(engine, plan)
        await stop(supervisor, children_of(supervisor.pid) | workers, log)


async def test_a_configuration_error_in_the_workers_stops_the_supervisor_with_exit_2(
    settings: Settings, tmp_path: Path
) -> None:
    log = tmp_path / "worker.log"
    # Given handler modules that the workers cannot import (the supervisor imports none)
    with supervised(settings, log, WORKER_HANDLERS="tests.integration.no_such_module") as sup:
        # Then the supervisor stops at once, restarting nothing, with the workers' exit 2
        await asyncio.to_thread(sup.wait, STOP_TIMEOUT)
        output = output_of(log)
        assert sup.returncode == 2, output
        assert "cannot import handler module 'tests.integration.no_such_module'" in output
        assert "a configuration error, which no restart can fix" in output
        assert "restarting it" not in output
        assert not children_of(sup.pid)


async def test_workers_that_keep_failing_at_start_make_the_supervisor_give_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a handler module whose import raises (exit 1: not a configuration error), and the
    # real supervisor with a quick policy (the default takes half a minute to give up)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("WORKER_HANDLERS", "tests.integration.broken_handlers")
    policy = RestartPolicy(first_delay=0.05, quick_deaths=2)
    commands = [child_command(["run"], 0)] * PROCESSES
    supervisor = Supervisor(commands, stop_timeout=STOP_TIMEOUT, policy=policy)

    # Then it stops them all and exits 1 once one of them died three times in a row
    assert await asyncio.wait_for(supervisor.run(), 60) == 1
    assert max(child.quick_deaths for child in supervisor.children) == policy.quick_deaths


async def test_worker_processes_stop_on_their_own_when_the_supervisor_is_killed(
    settings: Settings, amqp: AbstractRobustConnection, tmp_path: Path
) -> None:
    log = tmp_path / "worker.log"
    with supervised(settings, log) as supervisor:
        workers = await until_workers(supervisor, PROCESSES)
        await until_consumers(amqp, settings.queue, PROCESSES)

        # When the supervisor is killed, with no chance to stop its children
        supervisor.kill()
        await asyncio.to_thread(supervisor.wait, STOP_TIMEOUT)

        # Then each worker process notices, drains and exits by itself
        async def all_gone() -> bool:
            return not any(alive(pid) for pid in workers)

        await wait_until(all_gone, timeout=STOP_TIMEOUT)
        await until_consumers(amqp, settings.queue, 0)
        output = output_of(log)
        assert output.count("the supervisor is gone: stopping") == PROCESSES, output
