"""The checks that turn a delivery into an envelope, before any database work."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict

from worker import Context
from worker.core.codec import decode_json, fingerprint
from worker.core.envelope import Delivery, Envelope, open_envelope
from worker.core.router import Router
from worker.errors import (
    BodyTooLarge,
    InvalidBody,
    InvalidKey,
    MissingKey,
    NoHandler,
    Rejected,
    UndecodableBody,
)

LIMIT = 1024


class Order(BaseModel):
    model_config = ConfigDict(strict=True)

    order_id: str
    quantity: int


@pytest.fixture
def router() -> Router:
    router = Router()

    @router.handler("order.placed")
    async def place(body: Order, ctx: Context) -> None:
        pass

    @router.handler("note.added")
    async def note(body: dict[str, Any], ctx: Context) -> None:
        pass

    @router.handler("raw.value")
    async def raw(body, ctx):  # type: ignore[no-untyped-def]
        pass

    return router


def delivery(
    body: Any = None,
    routing_key: str = "order.placed",
    key: Any = "key-1",
    **fields: Any,
) -> Delivery:
    if body is None:
        body = {"order_id": "o1", "quantity": 2}
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {} if key is None else {"idempotency-key": key}
    return Delivery(body=raw, routing_key=routing_key, headers=headers, **fields)


def open_(router: Router, d: Delivery) -> Envelope:
    return open_envelope(d, router, max_body_bytes=LIMIT)


def test_a_valid_delivery_opens_with_its_handler_key_and_model(router: Router) -> None:
    env = open_(router, delivery())
    assert env.handler is router.find("order.placed")
    assert env.key == "key-1"
    assert env.payload == Order(order_id="o1", quantity=2)


def test_the_header_wins_over_the_message_id(router: Router) -> None:
    env = open_(router, delivery(key="from-header", message_id="from-message-id"))
    assert env.key == "from-header"


@pytest.mark.parametrize("headers", [{}, {"idempotency-key": ""}, {"idempotency-key": b""}])
def test_the_message_id_is_used_without_a_usable_header(
    router: Router, headers: dict[str, Any]
) -> None:
    d = Delivery(
        body=b'{"order_id": "o1", "quantity": 2}',
        routing_key="order.placed",
        headers=headers,
        message_id="m-1",
    )
    assert open_(router, d).key == "m-1"


@pytest.mark.parametrize("message_id", [None, ""])
def test_neither_header_nor_message_id_is_a_missing_key(
    router: Router, message_id: str | None
) -> None:
    with pytest.raises(MissingKey) as caught:
        open_(router, delivery(key=None, message_id=message_id))
    assert caught.value.reason == "missing-key"


def test_a_bytes_header_is_decoded(router: Router) -> None:
    env = open_(router, delivery(key="clé".encode()))
    assert env.key == "clé"


@pytest.mark.parametrize(
    ("key", "match"),
    [
        (42, "string"),
        (b"\xff\xfe", "UTF-8"),
        ("k" * 513, "longer than 512"),
        ("a\x00b", "NUL"),
    ],
)
def test_unfit_keys_are_invalid(router: Router, key: Any, match: str) -> None:
    with pytest.raises(InvalidKey, match=match) as caught:
        open_(router, delivery(key=key))
    assert caught.value.reason == "invalid-key"


def test_a_key_of_exactly_512_characters_is_accepted(router: Router) -> None:
    assert open_(router, delivery(key="k" * 512)).key == "k" * 512


def test_a_body_over_the_limit_is_too_large(router: Router) -> None:
    body = json.dumps({"order_id": "o" * LIMIT, "quantity": 1}).encode()
    with pytest.raises(BodyTooLarge) as caught:
        open_(router, delivery(body=body))
    assert caught.value.reason == "body-too-large"


def test_a_body_of_exactly_the_limit_is_not_too_large(router: Router) -> None:
    prefix = b'{"order_id": "'
    suffix = b'", "quantity": 1}'
    body = prefix + b"o" * (LIMIT - len(prefix) - len(suffix)) + suffix
    assert len(body) == LIMIT
    assert open_(router, delivery(body=body)).payload.quantity == 1


def test_the_size_is_checked_before_anything_else(router: Router) -> None:
    # Given a huge body that is also unroutable, keyless and not JSON
    d = Delivery(body=b"\xff" * (LIMIT + 1), routing_key="nobody.listens", headers={})
    # Then the size is what rejects it
    with pytest.raises(BodyTooLarge):
        open_(router, d)


def test_an_unknown_routing_key_has_no_handler(router: Router) -> None:
    with pytest.raises(NoHandler, match=r"nobody\.listens") as caught:
        open_(router, delivery(routing_key="nobody.listens"))
    assert caught.value.reason == "no-handler"


def test_routing_is_checked_before_the_key(router: Router) -> None:
    with pytest.raises(NoHandler):
        open_(router, delivery(routing_key="nobody.listens", key=None))


def test_an_undecodable_body_is_rejected(router: Router) -> None:
    with pytest.raises(UndecodableBody):
        open_(router, delivery(body=b"{not json"))


def test_a_body_that_fails_the_model_names_the_field(router: Router) -> None:
    with pytest.raises(InvalidBody, match="quantity") as caught:
        open_(router, delivery(body={"order_id": "o1", "quantity": "2"}))
    assert caught.value.reason == "invalid"
    assert "order_id" not in str(caught.value)


def test_a_missing_field_is_named(router: Router) -> None:
    with pytest.raises(InvalidBody, match="order_id"):
        open_(router, delivery(body={"quantity": 2}))


def test_the_dict_handler_gets_a_dict(router: Router) -> None:
    env = open_(router, delivery(body={"text": "hi", "n": 1}, routing_key="note.added"))
    assert env.payload == {"text": "hi", "n": 1}
    assert type(env.payload) is dict


def test_the_dict_handler_rejects_a_list(router: Router) -> None:
    with pytest.raises(InvalidBody, match="<body>"):
        open_(router, delivery(body=[1, 2], routing_key="note.added"))


def test_the_unannotated_handler_gets_the_raw_json_value(router: Router) -> None:
    env = open_(router, delivery(body=[1, "two", None], routing_key="raw.value"))
    assert env.payload == [1, "two", None]


def test_correlation_id_is_the_incoming_one(router: Router) -> None:
    env = open_(router, delivery(correlation_id="corr-9"))
    assert env.correlation_id == "corr-9"


def test_correlation_id_falls_back_to_the_key(router: Router) -> None:
    env = open_(router, delivery(key="key-7"))
    assert env.correlation_id == "key-7"


def test_the_fingerprint_is_that_of_the_decoded_json(router: Router) -> None:
    body = b'{ "quantity": 2,\n "order_id": "o1" }'
    env = open_(router, delivery(body=body))
    assert env.fingerprint == fingerprint(decode_json(body))
    assert env.fingerprint == fingerprint({"order_id": "o1", "quantity": 2})
    assert env.fingerprint != fingerprint({"order_id": "o1", "quantity": 3})


def test_an_out_of_range_number_is_rejected_not_an_internal_error(router: Router) -> None:
    with pytest.raises(Rejected):
        open_(router, delivery(body=b'{"x": 1e400}', routing_key="note.added"))
