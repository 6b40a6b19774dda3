"""The AsyncAPI document of the handler modules (``worker asyncapi``): what a deployment consumes
and publishes, for the people and tools on the other side of the broker.

Generated from the routers, never written by hand, so it cannot drift from the code: one channel
per routing key on the deployment's topic exchange; a ``receive`` operation for each handler,
with its body type's JSON schema (pydantic's) as the payload; a ``send`` operation for each
event a handler declares with ``publishes=``. Every message carries the ``idempotency-key``
header the consumer deduplicates on. The document follows AsyncAPI 3.0 with the AMQP 0-9-1
bindings; schemas shared by several messages appear once under ``components.schemas``.
"""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, version
from typing import Any
from urllib.parse import unquote, urlsplit

from pydantic import TypeAdapter

from worker.core.envelope import IDEMPOTENCY_KEY_HEADER, MAX_KEY_LENGTH
from worker.core.router import Router
from worker.settings import Settings

ASYNCAPI_VERSION = "3.0.0"
REF = "#/components/schemas/{model}"


def _modules(router: Router, settings: Settings) -> str:
    """The handler modules' names, as the title of their document: those the settings name,
    else (installed as entry points) the modules their handlers are defined in."""
    named = settings.handlers or sorted({h.func.__module__ for h in router.handlers()})
    return ", ".join(named) or "worker"


def document(router: Router, settings: Settings, *, title: str | None = None) -> dict[str, Any]:
    """The AsyncAPI 3.0 document of ``router``'s handlers, deployed as ``settings`` says."""
    schemas: dict[str, Any] = {}
    messages: dict[str, Any] = {}
    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}

    def channel(routing_key: str, body_type: Any) -> str:
        """The channel of ``routing_key`` (created once), with its message; its id."""
        channel_id = _identifier(routing_key)
        if channel_id not in channels:
            message_id = _identifier(f"{routing_key}.message")
            messages[message_id] = {
                "name": routing_key,
                "contentType": "application/json",
                "headers": _HEADERS,
                "payload": _schema(body_type, schemas),
            }
            channels[channel_id] = {
                "address": routing_key,
                "messages": {message_id: {"$ref": f"#/components/messages/{message_id}"}},
                "bindings": {"amqp": _channel_binding(settings)},
            }
        return channel_id

    for handler in sorted(router.handlers(), key=lambda h: h.routing_key):
        channel_id = channel(handler.routing_key, handler.body_type)
        operations[_identifier(f"receive.{handler.name}")] = {
            "action": "receive",
            "channel": {"$ref": f"#/channels/{channel_id}"},
            "summary": _summary(handler.func),
            "messages": _messages_of(channel_id, channels),
            "bindings": {"amqp": {"ack": True, "bindingVersion": "0.3.0"}},
        }
        for routing_key, body_type in handler.publishes:
            emitted = channel(routing_key, body_type)
            operations[_identifier(f"send.{routing_key}.from.{handler.name}")] = {
                "action": "send",
                "channel": {"$ref": f"#/channels/{emitted}"},
                "summary": f"published through the outbox by {handler.name}, after its commit",
                "messages": _messages_of(emitted, channels),
                "bindings": {
                    "amqp": {"deliveryMode": 2, "mandatory": True, "bindingVersion": "0.3.0"}
                },
            }

    return {
        "asyncapi": ASYNCAPI_VERSION,
        "info": {
            "title": title or _modules(router, settings),
            "version": _version(),
            "description": (
                "Messages are handled at most once per idempotency key (the `idempotency-key` "
                "header, else the message id) and acked after their effect committed; events "
                "are published through a transactional outbox, at least once, each under a "
                "stable message id."
            ),
        },
        "defaultContentType": "application/json",
        "servers": _servers(settings),
        "channels": dict(sorted(channels.items())),
        "operations": dict(sorted(operations.items())),
        "components": {"messages": dict(sorted(messages.items())), "schemas": schemas},
    }


_HEADERS = {
    "type": "object",
    "properties": {
        IDEMPOTENCY_KEY_HEADER: {
            "type": "string",
            "minLength": 1,
            "maxLength": MAX_KEY_LENGTH,
            "description": "the key a consumer deduplicates on (default: the message id)",
        }
    },
}


def _schema(body_type: Any, schemas: dict[str, Any]) -> dict[str, Any]:
    """``body_type``'s JSON schema, its named models moved into ``schemas`` (shared) and the
    schema itself referenced from there when it is a model."""
    schema = TypeAdapter(body_type).json_schema(ref_template=REF)
    schemas.update(schema.pop("$defs", {}))
    title = schema.get("title")
    if schema.get("type") == "object" and isinstance(title, str) and _is_model(body_type):
        schemas[title] = schema
        return {"$ref": REF.format(model=title)}
    return schema


def _is_model(body_type: Any) -> bool:
    return isinstance(body_type, type) and hasattr(body_type, "model_json_schema")


def _servers(settings: Settings) -> dict[str, Any]:
    """The broker's nodes: ``rabbitmq``, and ``rabbitmq-2``, ... for the other nodes of a
    cluster."""
    servers = {}
    for number, raw in enumerate(settings.amqp_urls, start=1):
        url = urlsplit(raw)
        servers["rabbitmq" if number == 1 else f"rabbitmq-{number}"] = {
            "host": f"{url.hostname or 'localhost'}:{url.port or 5672}",
            "protocol": "amqps" if url.scheme == "amqps" else "amqp",
            "protocolVersion": "0-9-1",
        }
    return servers


def _channel_binding(settings: Settings) -> dict[str, Any]:
    vhost = unquote(urlsplit(settings.amqp_urls[0]).path.lstrip("/")) or "/"
    return {
        "is": "routingKey",
        "exchange": {
            "name": settings.exchange,
            "type": "topic",
            "durable": True,
            "autoDelete": False,
            "vhost": vhost,
        },
        "bindingVersion": "0.3.0",
    }


def _messages_of(channel_id: str, channels: dict[str, Any]) -> list[dict[str, str]]:
    return [
        {"$ref": f"#/channels/{channel_id}/messages/{message_id}"}
        for message_id in channels[channel_id]["messages"]
    ]


def _identifier(text: str) -> str:
    """``text`` as an AsyncAPI component id (letters, digits, ``.``, ``_``, ``-``)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", text)


def _summary(func: Any) -> str:
    doc = (getattr(func, "__doc__", None) or "").strip()
    return doc.split("\n\n", 1)[0].replace("\n", " ") or func.__qualname__


def _version() -> str:
    try:
        return version("rabbit-outbox-worker")
    except PackageNotFoundError:  # (run from a checkout that is not installed)
        return "0"
