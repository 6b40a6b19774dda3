"""The least-privilege broker users of ``deploy/rabbitmq/definitions.json``, checked against the
real RabbitMQ: the users are created with the file's permissions in a virtual host of their own
(deleted afterwards), a producer may publish to the events exchange and nowhere else, and the
worker runs its whole failure path (retry, park, replay, relay) with the worker user's rights.
A node of its own, booted from ``deploy/rabbitmq`` as compose boots its broker, has the users
(and no guest) and refuses messages beyond ``max_message_size``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import aio_pika
import pytest
from aio_pika.abc import AbstractChannel, AbstractRobustConnection
from aiormq.exceptions import (
    ChannelAccessRefused,
    ChannelPreconditionFailed,
    ProbableAuthenticationError,
)
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.helpers import free_port, wait_until
from tests.integration.support import BASE, running_worker
from worker import Context, Permanent, Retryable, Router
from worker.ops import dlq
from worker.ops.permissions import DEFAULT_EXCHANGE, producer_permissions, worker_permissions
from worker.settings import Settings
from worker.telemetry import Count
from worker.transport.connection import connect
from worker.transport.topology import declare_topology, queue_names

DEFINITIONS = Path(__file__).resolve().parents[2] / "deploy" / "rabbitmq" / "definitions.json"
JOB, DONE = "payment.requested", "perm.done"
"""(JOB: a routing key the producer's topic permission lets it write; DONE: the worker's own)"""

needs_rabbitmqctl = pytest.mark.skipif(
    shutil.which("rabbitmqctl") is None, reason="needs rabbitmqctl"
)


def definitions() -> dict[str, Any]:
    found = json.loads(DEFINITIONS.read_text())
    assert isinstance(found, dict)
    return found


def permissions_of(user: str) -> dict[str, str]:
    (entry,) = [p for p in definitions()["permissions"] if p["user"] == user]
    return {kind: entry[kind] for kind in ("configure", "write", "read")}


def matches(pattern: str, name: str) -> bool:
    return re.search(pattern, name) is not None


def test_the_definitions_grant_the_permissions_the_worker_derives() -> None:
    defaults = Settings()
    assert permissions_of("worker") == vars(worker_permissions(defaults))
    assert permissions_of("producer") == vars(producer_permissions(defaults))
    assert permissions_of("admin") == {"configure": ".*", "write": ".*", "read": ".*"}
    admin = next(user for user in definitions()["users"] if user["name"] == "admin")
    assert "administrator" in admin["tags"]


def test_the_worker_may_use_every_name_it_declares_and_a_producer_only_events() -> None:
    defaults = Settings()
    worker, producer = worker_permissions(defaults), producer_permissions(defaults)
    own = [*queue_names(defaults), defaults.exchange, defaults.dead_letter_exchange]
    own.append(defaults.retry_queue(3600.0))  # any delay the operator may configure
    for name in own:
        assert matches(worker.configure, name), name
        assert matches(worker.write, name), name
        assert matches(worker.read, name), name
    assert matches(worker.write, DEFAULT_EXCHANGE)
    for foreign in ("workers", "xworker", "other", "amq.topic", "events.x", "worker.dlq.x"):
        assert not matches(worker.configure, foreign), foreign
    for forbidden in (DEFAULT_EXCHANGE, defaults.dead_letter_exchange, defaults.queue, "amq.topic"):
        assert not matches(producer.write, forbidden), forbidden
    assert matches(producer.write, defaults.exchange)
    assert not matches(producer.configure, defaults.exchange)
    assert not matches(producer.read, defaults.queue)


def test_no_user_of_the_definitions_has_a_password_that_works_as_it_is() -> None:
    """An empty hash: no password logs in until one is set (``deploy/rabbitmq/set-passwords``,
    or ``rabbitmqctl change_password``)."""
    for user in definitions()["users"]:
        assert user["hashing_algorithm"] == "rabbit_password_hashing_sha256"
        assert user["password_hash"] == "", user["name"]


def test_the_producer_may_write_only_the_routing_keys_clients_send() -> None:
    """Topic permissions on ``events``: the payments example's producer sends requests, never
    the worker's own events."""
    (topic,) = definitions()["topic_permissions"]
    assert (topic["user"], topic["exchange"]) == ("producer", Settings().exchange)
    assert matches(topic["write"], "payment.requested")
    for forbidden in ("payment.settled", "payment.requested.x", "xpayment.requested", "#"):
        assert not matches(topic["write"], forbidden), forbidden


def test_the_events_exchange_is_defined_as_the_worker_declares_it() -> None:
    (exchange,) = definitions()["exchanges"]
    assert exchange["name"] == Settings().exchange
    assert (exchange["type"], exchange["durable"], exchange["auto_delete"]) == (
        "topic",
        True,
        False,
    )


async def rabbitmqctl(*argv: str, stdin: str | None = None) -> None:
    await asyncio.to_thread(
        subprocess.run, ["rabbitmqctl", "-q", *argv], input=stdin, text=True, check=True
    )


def password_hash(password: str) -> str:
    """RabbitMQ's ``rabbit_password_hashing_sha256``: base64 of salt + SHA-256(salt + password)."""
    salt = uuid.uuid4().bytes[:4]
    return base64.b64encode(salt + hashlib.sha256(salt + password.encode()).digest()).decode()


class Users:
    """The file's ``worker`` and ``producer`` users, created under unique names in a virtual
    host of their own; settings with the worker's default names, connecting as the worker."""

    def __init__(self, settings: Settings) -> None:
        suffix = uuid.uuid4().hex[:8]
        self.vhost = f"worker-permissions-{suffix}"
        self.names = {role: f"{role}-{suffix}" for role in ("worker", "producer")}
        self.settings = settings.replace(
            amqp_url=self.url("worker"), exchange="events", queue="worker"
        )

    def url(self, role: str) -> str:
        base = urlsplit(BASE.amqp_url)
        netloc = f"{self.names[role]}:secret@{base.hostname}:{base.port or 5672}"
        return base._replace(netloc=netloc, path="/" + quote(self.vhost, safe="")).geturl()

    async def create(self) -> None:
        """Import the file's users, permissions and exchanges, renamed into the new host."""
        found = definitions()
        renamed = {
            "vhosts": [{"name": self.vhost}],
            "users": [
                {
                    "name": name,
                    "password_hash": password_hash("secret"),
                    "hashing_algorithm": "rabbit_password_hashing_sha256",
                    "tags": "",
                }
                for name in self.names.values()
            ],
            "permissions": [
                {**entry, "user": self.names[entry["user"]], "vhost": self.vhost}
                for entry in found["permissions"]
                if entry["user"] in self.names
            ],
            "topic_permissions": [
                {**entry, "user": self.names[entry["user"]], "vhost": self.vhost}
                for entry in found["topic_permissions"]
                if entry["user"] in self.names
            ],
            "exchanges": [{**entry, "vhost": self.vhost} for entry in found["exchanges"]],
        }
        await rabbitmqctl("import_definitions", "--format", "json", stdin=json.dumps(renamed))

    async def delete(self) -> None:
        await asyncio.gather(
            rabbitmqctl("delete_vhost", self.vhost),
            *(rabbitmqctl("delete_user", name) for name in self.names.values()),
        )


@pytest.fixture
async def users(settings: Settings) -> AsyncIterator[Users]:
    created = Users(settings)
    await created.create()
    try:
        yield created
    finally:
        await created.delete()


async def refused(publish: Any) -> bool:
    try:
        await publish
    except ChannelAccessRefused:
        return True
    return False


async def on_new_channel(connection: AbstractRobustConnection) -> AbstractChannel:
    """A channel of its own: a refusal closes the channel it happens on."""
    return await connection.channel(publisher_confirms=True)


@needs_rabbitmqctl
async def test_a_producer_may_publish_to_the_events_exchange_and_nowhere_else(
    users: Users,
) -> None:
    # Given the worker's topology, declared by the worker user
    worker = await aio_pika.connect_robust(users.url("worker"))
    producer = await aio_pika.connect_robust(users.url("producer"))
    async with worker, producer:
        async with worker.channel() as channel:
            await declare_topology(channel, users.settings, [JOB])
        queue, dlx = users.settings.queue, users.settings.dead_letter_exchange
        message = aio_pika.Message(b"{}", headers={"idempotency-key": "k"})

        # When the producer publishes to the events exchange, it is delivered
        events = await (await on_new_channel(producer)).get_exchange("events")
        await events.publish(message, routing_key=JOB)
        assert await broker_depth_in(users, queue) == 1

        # and everything else is refused: another routing key (the worker's own event) too
        events = await (await on_new_channel(producer)).get_exchange("events")
        assert await refused(events.publish(message, routing_key="payment.settled"))
        default = (await on_new_channel(producer)).default_exchange
        assert await refused(default.publish(message, routing_key=queue))
        forged = await (await on_new_channel(producer)).get_exchange(dlx, ensure=False)
        assert await refused(forged.publish(message, routing_key=JOB))
        assert await refused((await on_new_channel(producer)).declare_queue("mine"))
        work_queue = await (await on_new_channel(producer)).get_queue(queue)
        assert await refused(work_queue.get(no_ack=True))

        assert await broker_depth_in(users, queue) == 1
        assert await broker_depth_in(users, users.settings.dead_letter_queue) == 0


async def broker_depth_in(users: Users, queue: str) -> int:
    """``broker_depth`` of a queue in the users' virtual host."""
    listing = await asyncio.to_thread(
        subprocess.run,
        ["rabbitmqctl", "-q", "list_queues", "-p", users.vhost, "name", "messages"],
        capture_output=True,
        text=True,
        check=True,
    )
    for line in listing.stdout.splitlines():
        name, count = line.split("\t")
        if name == queue:
            return int(count)
    raise AssertionError(f"queue {queue} not found")


def failing_router(done: list[str]) -> Router:
    """``JOB``: a retry first, then a permanent failure for ``k-fail`` and an event for
    the rest; ``perm.done`` records the events that came back."""
    router = Router()

    @router.handler(JOB)
    async def job(body: dict[str, Any], ctx: Context) -> None:
        if ctx.attempt == 1:
            raise Retryable("try again later")
        if ctx.key == "k-fail":
            raise Permanent("declined")
        ctx.publish(DONE, {"key": ctx.key})

    @router.handler(DONE)
    async def record(body: dict[str, Any], ctx: Context) -> None:
        done.append(body["key"])

    return router


@needs_rabbitmqctl
async def test_the_worker_runs_its_failure_path_with_the_worker_users_rights(
    users: Users, engine: AsyncEngine
) -> None:
    done: list[str] = []
    settings = users.settings
    async with running_worker(settings, failing_router(done)) as worker:
        producer = await aio_pika.connect_robust(users.url("producer"))
        async with producer:
            events = await (await on_new_channel(producer)).get_exchange("events")
            for key in ("k-ok", "k-fail"):
                await events.publish(
                    aio_pika.Message(b"{}", headers={"idempotency-key": key}), routing_key=JOB
                )

        async def parked_and_published() -> bool:
            return worker.stats[Count.DEAD_LETTERED] >= 1 and done == ["k-ok"]

        # Then both went through a delayed retry, one was parked, the other's event came back
        await wait_until(parked_and_published)
        assert worker.stats[Count.RETRY_SCHEDULED] == 2

        # and the DLQ can be replayed with the same rights
        connection = await aio_pika.connect_robust(settings.amqp_url)
        async with connection:
            replayed = await dlq.replay(connection, engine, settings)
        assert [parked.key for parked in replayed] == ["k-fail"]

        async def parked_again() -> bool:
            return worker.stats[Count.DEAD_LETTERED] >= 2

        # (a replay starts afresh: a delayed retry, then the same permanent failure)
        await wait_until(parked_again)
    assert worker.stats[Count.RETRY_SCHEDULED] == 3
    assert await broker_depth_in(users, settings.dead_letter_queue) == 1
    assert await broker_depth_in(users, settings.queue) == 0


SET_PASSWORDS = DEFINITIONS.parent / "set-passwords"

RABBITMQ_SERVER = Path("/usr/lib/rabbitmq/bin/rabbitmq-server")
"""The server script itself (``/usr/sbin``'s wrapper would run it as another user)."""


@contextlib.contextmanager
def node_from_deploy(home: Path) -> Iterator[tuple[int, list[str]]]:
    """A RabbitMQ node of its own, configured by ``deploy/rabbitmq`` as compose configures its
    broker, on a free port; yields the port and the ``rabbitmqctl`` command that reaches it;
    stopped afterwards."""
    config = (DEFINITIONS.parent / "rabbitmq.conf").read_text()
    config = config.replace("/etc/rabbitmq/definitions.json", str(DEFINITIONS))
    port, node = free_port(), f"worker-deploy-{uuid.uuid4().hex[:8]}@localhost"
    (home / "rabbitmq.conf").write_text(f"{config}\nlisteners.tcp.default = 127.0.0.1:{port}\n")
    (home / "enabled_plugins").write_text("[].\n")
    cookie = uuid.uuid4().hex
    (home / ".erlang.cookie").write_text(cookie)
    (home / ".erlang.cookie").chmod(0o400)
    env = {
        **os.environ,
        "HOME": str(home),
        "RABBITMQ_NODENAME": node,
        "RABBITMQ_NODE_PORT": str(port),
        "RABBITMQ_DIST_PORT": str(free_port()),
        "RABBITMQ_MNESIA_BASE": str(home / "mnesia"),
        "RABBITMQ_LOG_BASE": str(home / "log"),
        "RABBITMQ_CONFIG_FILE": str(home / "rabbitmq.conf"),
        "RABBITMQ_ENABLED_PLUGINS_FILE": str(home / "enabled_plugins"),
        "RABBITMQ_CONF_ENV_FILE": str(home / "rabbitmq-env.conf"),
    }
    control = ["rabbitmqctl", "-q", "-n", node, "--erlang-cookie", cookie]
    subprocess.run([str(RABBITMQ_SERVER), "-detached"], env=env, check=True, timeout=60)
    try:
        _await_startup(control)
        yield port, control
    finally:
        subprocess.run([*control, "stop"], check=False, capture_output=True, timeout=60)


def _await_startup(control: list[str], attempts: int = 120) -> None:
    """Wait for the node to run RabbitMQ (``await_startup`` fails while the node has not yet
    registered, so it is asked again, a second apart)."""
    for _ in range(attempts):
        started = subprocess.run(
            [*control, "await_startup", "--timeout", "60"], capture_output=True, timeout=90
        )
        if started.returncode == 0:
            return
        time.sleep(1)
    raise AssertionError(f"the node did not start: {started.stderr.decode()}")


@needs_rabbitmqctl
@pytest.mark.skipif(not RABBITMQ_SERVER.exists(), reason=f"needs {RABBITMQ_SERVER}")
async def test_a_broker_started_from_deploy_has_the_users_and_the_size_limit(
    tmp_path: Path,
) -> None:
    with node_from_deploy(tmp_path) as (port, control):
        url = f"amqp://{{0}}:{{1}}@127.0.0.1:{port}/"

        # The guest user does not exist, and no other logs in before it is given a password
        with pytest.raises(ProbableAuthenticationError):
            await connect(url.format("guest", "guest"))
        for user in ("admin", "worker", "producer"):
            for guess in (user, ""):
                with pytest.raises(ProbableAuthenticationError):
                    await connect(url.format(user, guess))

        # Once set-passwords (compose's health check) has run, each logs in with its own
        passwords = {user: f"{user}-{uuid.uuid4().hex}" for user in ("admin", "worker", "producer")}
        given = " ".join(f"{user}:{password}" for user, password in passwords.items())
        environ = {
            **os.environ,
            "BROKER_PASSWORDS": given,
            "BROKER_PASSWORDS_MARKER": str(tmp_path / "passwords-set"),
            "RABBITMQCTL": " ".join(c for c in control if c != "-q"),
        }
        await asyncio.to_thread(
            subprocess.run, [str(SET_PASSWORDS)], env=environ, check=True, timeout=120
        )
        admin = await aio_pika.connect(url.format("admin", passwords["admin"]))
        worker = await aio_pika.connect(url.format("worker", passwords["worker"]))
        producer = await aio_pika.connect(url.format("producer", passwords["producer"]))
        async with admin, worker, producer:
            # the events exchange exists before any worker declared it
            events = await (await on_new_channel(producer)).get_exchange("events")
            await events.publish(aio_pika.Message(b"{}"), routing_key=JOB)
            settled = await (await on_new_channel(producer)).get_exchange("events")
            assert await refused(settled.publish(aio_pika.Message(b"{}"), "payment.settled"))
            assert await refused(
                (await on_new_channel(producer)).default_exchange.publish(
                    aio_pika.Message(b"{}"), routing_key="worker"
                )
            )

            # and a body the worker accepts passes, one the broker's limit exceeds does not
            channel = await on_new_channel(worker)
            queue = await channel.declare_queue("worker", durable=True)
            max_body = Settings().max_body_bytes
            await channel.default_exchange.publish(
                aio_pika.Message(b"x" * max_body), routing_key=queue.name
            )
            too_large = aio_pika.Message(b"x" * (max_body + 64 * 1024 + 1))
            with pytest.raises(ChannelPreconditionFailed, match="max size"):
                await (await on_new_channel(worker)).default_exchange.publish(
                    too_large, routing_key=queue.name
                )
