"""Several broker addresses in ``amqp_url``: how the list is read, redacted, and walked through by
the connection (against closed local ports: nothing here needs a broker)."""

from __future__ import annotations

import itertools
import logging

import aio_pika
import pytest
from aio_pika.exceptions import CONNECTION_EXCEPTIONS

from examples.payments import router as payments
from tests.helpers import free_port
from worker.errors import ConfigurationError
from worker.liveness import Liveness
from worker.ops import asyncapi
from worker.settings import Settings, broker_urls, redact
from worker.transport.connection import _Connection, connect


@pytest.mark.parametrize(
    ("raw", "urls"),
    [
        ("amqp://u:p@a:5672/", ("amqp://u:p@a:5672/",)),
        (
            "amqp://u:p@a:5672/,amqp://u:p@b:5672/, amqps://u:p@c:5671/vh ",
            ("amqp://u:p@a:5672/", "amqp://u:p@b:5672/", "amqps://u:p@c:5671/vh"),
        ),
        # a comma inside a URL (password, query) is no separator: only one before a scheme is
        ("amqp://u:a,b@a/,AMQP://u:c,d@b/", ("amqp://u:a,b@a/", "AMQP://u:c,d@b/")),
        (
            "amqps://u:p@a/?cafile=/x,y.pem,amqps://u:p@b/",
            ("amqps://u:p@a/?cafile=/x,y.pem", "amqps://u:p@b/"),
        ),
    ],
)
def test_broker_urls_split_on_commas_before_a_scheme(raw: str, urls: tuple[str, ...]) -> None:
    assert broker_urls(raw) == urls


def test_the_setting_takes_a_list_and_keeps_its_name() -> None:
    settings = Settings.load({"WORKER_AMQP_URL": "amqp://g:g@a:5681/ , amqp://g:g@b:5682/"})

    assert settings.amqp_url == "amqp://g:g@a:5681/,amqp://g:g@b:5682/"
    assert settings.amqp_urls == ("amqp://g:g@a:5681/", "amqp://g:g@b:5682/")
    assert Settings().amqp_urls == (Settings().amqp_url,)


@pytest.mark.parametrize(
    "raw", ["http://a/", "amqp://a/,https://b/", "amqp:///vhost", ",", "rabbit:5672"]
)
def test_a_list_with_something_else_than_broker_urls_names_the_variable(raw: str) -> None:
    with pytest.raises(ConfigurationError, match=r"WORKER_AMQP_URL=.*amqp:// or amqps://"):
        Settings.load({"WORKER_AMQP_URL": raw})


def test_redact_hides_the_password_of_every_url_of_a_list() -> None:
    redacted = redact("amqp://u:one@a:5681/,amqp://u:two@b:5682/,amqp://c:5683/")

    assert redacted == "amqp://u:***@a:5681/,amqp://u:***@b:5682/,amqp://c:5683/"


async def test_each_failed_attempt_moves_the_next_one_on_to_the_next_node() -> None:
    ports = [free_port() for _ in range(3)]
    urls = [f"amqp://guest:guest@127.0.0.1:{port}/" for port in ports]
    connection = _Connection(urls, "test", Liveness.default())
    tried = []
    try:
        for _ in range(4):
            tried.append(connection.url.port)
            # (the attempt aio-pika's reconnect loop makes, on whatever ``url`` is now)
            with pytest.raises(CONNECTION_EXCEPTIONS):
                await aio_pika.Connection.connect(connection)
    finally:
        await connection.close()

    assert tried == [*ports, ports[0]]


async def test_a_first_connect_tries_every_node_in_order_then_raises_the_last_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ports = [free_port() for _ in range(3)]
    urls = ",".join(f"amqp://guest:s3cret@127.0.0.1:{port}/" for port in ports)

    with caplog.at_level(logging.WARNING), pytest.raises(CONNECTION_EXCEPTIONS) as raised:
        await connect(urls, within=5)

    assert str(ports[2]) in str(raised.value)
    tried = [r.getMessage() for r in caplog.records if r.name == "worker.transport.connection"]
    assert len(tried) == 2
    for record, (port, following) in zip(tried, itertools.pairwise(ports), strict=True):
        assert f"127.0.0.1:{port}/" in record
        assert f"trying amqp://guest:***@127.0.0.1:{following}/" in record
    assert "s3cret" not in caplog.text


def test_the_asyncapi_document_names_every_node_as_a_server() -> None:
    settings = Settings(amqp_url="amqp://u:p@a:5681/prod,amqps://u:p@b:5671/prod")

    servers = asyncapi.document(payments, settings)["servers"]

    assert servers == {
        "rabbitmq": {"host": "a:5681", "protocol": "amqp", "protocolVersion": "0-9-1"},
        "rabbitmq-2": {"host": "b:5671", "protocol": "amqps", "protocolVersion": "0-9-1"},
    }
