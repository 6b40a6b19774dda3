"""``worker asyncapi``: the document of the example handler modules, generated from their
routers, with every reference resolving and each handler's body schema as its payload."""

from __future__ import annotations

import json
from typing import Any

from examples.orders import router as orders
from examples.payments import router as payments
from tests.helpers import WORKER_SCRIPT, run
from worker.core.router import Router
from worker.ops import asyncapi
from worker.settings import Settings

SETTINGS = Settings(amqp_url="amqps://u:p@mq.example:5671/prod%2Feu", exchange="shop-events")


def resolve(document: dict[str, Any], ref: str) -> Any:
    node: Any = document
    for part in ref.removeprefix("#/").split("/"):
        node = node[part]
    return node


def refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return own + [ref for value in node.values() for ref in refs(value)]
    if isinstance(node, list):
        return [ref for value in node for ref in refs(value)]
    return []


def test_the_payments_document_has_a_channel_per_routing_key_and_what_each_handler_does() -> None:
    doc = asyncapi.document(payments, SETTINGS, title="payments")

    assert doc["asyncapi"] == "3.0.0"
    assert set(doc["channels"]) == {"payment.requested", "payment.settled"}
    operations = {
        (op["action"], op["channel"]["$ref"].rsplit("/", 1)[1]) for op in doc["operations"].values()
    }
    assert operations == {
        ("receive", "payment.requested"),
        ("receive", "payment.settled"),
        ("send", "payment.settled"),  # declared with publishes= by the batch handler
    }
    binding = doc["channels"]["payment.requested"]["bindings"]["amqp"]
    assert binding["exchange"] == {
        "name": "shop-events",
        "type": "topic",
        "durable": True,
        "autoDelete": False,
        "vhost": "prod/eu",
    }
    assert doc["servers"]["rabbitmq"] == {
        "host": "mq.example:5671",
        "protocol": "amqps",
        "protocolVersion": "0-9-1",
    }
    for ref in refs(doc):
        assert resolve(doc, ref) is not None, ref


def test_payloads_are_the_handlers_models() -> None:
    doc = asyncapi.document(payments, SETTINGS)
    message = resolve(
        doc, doc["channels"]["payment.requested"]["messages"]["payment.requested.message"]["$ref"]
    )
    payload = resolve(doc, message["payload"]["$ref"])
    assert set(payload["required"]) == {"payment_id", "account", "amount_cents"}
    assert payload["properties"]["amount_cents"]["exclusiveMinimum"] == 0
    settled = doc["components"]["schemas"]["PaymentSettled"]
    assert "balance_cents" in settled["required"]
    assert message["headers"]["properties"]["idempotency-key"]["maxLength"] == 512


def test_routers_combine_into_one_document() -> None:
    both = Router()
    both.include(payments)
    both.include(orders)
    doc = asyncapi.document(both, SETTINGS)
    assert {"order.placed", "order.shipped", "payment.requested"} <= set(doc["channels"])
    for ref in refs(doc):
        resolve(doc, ref)


def test_the_command_prints_the_document() -> None:
    result = run(WORKER_SCRIPT, "asyncapi", "--handlers", "examples.payments", "--title", "t")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["info"]["title"] == "t"


def test_the_title_names_the_handler_modules_even_when_installed() -> None:
    # Named in the settings: those names; installed (none named): their handlers' modules
    named = asyncapi.document(payments, SETTINGS.replace(handlers=("examples.payments",)))
    installed = asyncapi.document(payments, SETTINGS.replace(handlers=()))
    assert named["info"]["title"] == "examples.payments"
    modules = {h.func.__module__ for h in payments.handlers()}
    assert installed["info"]["title"] == ", ".join(sorted(modules))
    assert installed["info"]["title"].startswith("examples.payments")
