"""What an HTTP client may reach through the ingress: only its own requests and their results
(never a message sent over AMQP, never another client's), only the routing keys it is meant to
(not the worker's own events), and the event it makes carries the canonical JSON its handler
validated. Against a real uvicorn server, the real PostgreSQL, RabbitMQ and worker."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import aio_pika
import httpx
import pytest
from pydantic import BaseModel
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from examples.payments import router as payments
from tests.helpers import rows, scalar, wait_until
from tests.integration.support import BASE, publish, require_services, running_worker
from tests.integration.test_ingress import (
    REQUESTED,
    count,
    handled,
    ingress,
    is_problem,
    keyed,
    nothing_stored,
    payment,
)
from worker import Context, Router, schema, testing
from worker.core.codec import canonical_json, fingerprint
from worker.database import create_engine
from worker.errors import ConfigurationError
from worker.ingress.problems import PROBLEM_JSON
from worker.settings import Settings
from worker.telemetry import Count

ALICE = "alice:alice-token-0123456789"
ALICE_NEXT = "alice:alice-next-token-98765"  # (a second token of the same client: a rotation)
BOB = "bob:bob-token-0123456789abcd"
BARE = "a-bare-token-0123456789abc"
TOKENS = (ALICE, ALICE_NEXT, BOB, BARE)


class PaymentInEuros(BaseModel):
    """A payment body that also needs a currency: the handler's body type after a change."""

    payment_id: str
    currency: str


stricter = Router()


@stricter.handler("payment.requested")
async def request_in_euros(msg: PaymentInEuros, ctx: Context) -> None:
    """Never runs in the tests: the bodies the ingress accepted lack ``currency``."""


def as_(entry: str) -> dict[str, str]:
    """The Authorization header of a token entry (``name:token`` or a bare token)."""
    return {"authorization": f"Bearer {entry.rpartition(':')[2]}"}


def result_of(response: httpx.Response) -> Any:
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] == "completed", body
    return body["result"]


async def publish_over_amqp(settings: Settings, body: Any, key: str) -> None:
    """A ``payment.requested`` message with ``key``, as an application publishes it."""
    connection = await aio_pika.connect(settings.amqp_url)
    async with connection:
        await publish(await connection.channel(), settings, body, key=key, message_id=key)


async def handled_over_amqp(settings: Settings, engine: AsyncEngine, body: Any, key: str) -> None:
    """``body`` published over AMQP under ``key`` and handled by a worker, stopped after."""
    async with running_worker(settings, payments):
        await publish_over_amqp(settings, body, key)
        await handled_all(engine, 1)


async def handled_all(engine: AsyncEngine, count_: int) -> None:
    async def reached() -> bool:
        return await handled(engine, "payment.requested") >= count_

    await wait_until(reached, timeout=30)


async def test_a_result_of_a_message_sent_over_amqp_is_not_readable_over_http(
    settings: Settings, engine: AsyncEngine
) -> None:
    # Given a payment that arrived over AMQP and was handled (its result: carol's balance)
    await handled_over_amqp(settings, engine, payment("amqp-1", "carol", 4242), "amqp-secret-1")

    # When anyone asks the ingress for it by its key, with or without a token
    path = f"{REQUESTED}/amqp-secret-1"
    async with ingress(settings) as client:
        anonymous = await client.get(path)
    async with ingress(settings, ingress_tokens=TOKENS) as client:
        with_token = await client.get(path, headers=as_(ALICE))

    # Then it is unknown there
    for response in (anonymous, with_token):
        assert is_problem(response, 404, "unknown-message"), response.text
        assert "4242" not in response.text


async def test_a_client_reads_only_its_own_requests_and_has_keys_of_its_own(
    settings: Settings, engine: AsyncEngine
) -> None:
    async with ingress(settings, ingress_tokens=TOKENS) as client:
        # Given alice's payment under key k1
        alice = await client.post(
            REQUESTED, json=payment("pa", "alice", 100), headers=keyed("k1", **as_(ALICE))
        )
        # When bob and a bare token read k1, and bob posts k1 with a body of his own
        bob_reads = await client.get(f"{REQUESTED}/k1", headers=as_(BOB))
        bare_reads = await client.get(f"{REQUESTED}/k1", headers=as_(BARE))
        bob = await client.post(
            REQUESTED, json=payment("pb", "bob", 7), headers=keyed("k1", **as_(BOB))
        )
        async with running_worker(settings, payments):
            await handled_all(engine, 2)
        alice_result = await client.get(f"{REQUESTED}/k1", headers=as_(ALICE))
        rotated_result = await client.get(f"{REQUESTED}/k1", headers=as_(ALICE_NEXT))
        bob_result = await client.get(f"{REQUESTED}/k1", headers=as_(BOB))
        bare_after = await client.get(f"{REQUESTED}/k1", headers=as_(BARE))

    # Then neither read alice's request, and bob's k1 is a request of his own (no 422)
    assert alice.status_code == bob.status_code == 202, (alice.text, bob.text)
    assert "idempotent-replayed" not in bob.headers
    assert alice.json()["handler_key"] == "http:alice:k1"
    assert bob.json()["handler_key"] == "http:bob:k1"
    for refused in (bob_reads, bare_reads, bare_after):
        assert is_problem(refused, 404, "unknown-message"), refused.text
    # And each client reads its own result; a second token of alice's reads hers too
    assert result_of(alice_result)["payment_id"] == "pa"
    assert result_of(rotated_result) == result_of(alice_result)
    assert result_of(bob_result)["payment_id"] == "pb"
    assert await count(engine, "ledger_entries") == 2


async def test_an_http_key_equal_to_an_amqp_key_neither_parks_nor_reads_the_amqp_message(
    settings: Settings, engine: AsyncEngine
) -> None:
    async with running_worker(settings, payments) as worker, ingress(settings) as client:
        # Given an HTTP request of key order-1001, handled
        posted = await client.post(
            REQUESTED, json=payment("p-http", "dave", 10), headers=keyed("order-1001")
        )
        await handled_all(engine, 1)
        # When the application's own order-1001 arrives over AMQP, with another body
        await publish_over_amqp(settings, payment("p-amqp", "erin", 5000), "order-1001")
        await handled_all(engine, 2)
        # and an HTTP client posts the key of an AMQP message handled before, another body
        await publish_over_amqp(settings, payment("p-amqp-2", "erin", 6000), "amqp-2")
        await handled_all(engine, 3)
        reusing = await client.post(
            REQUESTED, json=payment("p-http-2", "dave", 20), headers=keyed("amqp-2")
        )
        await handled_all(engine, 4)
        http_result = await client.get(f"{REQUESTED}/order-1001")
        reused_result = await client.get(f"{REQUESTED}/amqp-2")
        parked = worker.stats[Count.DEAD_LETTERED]

    # Then the AMQP messages were handled, not parked as a reused key
    assert posted.status_code == reusing.status_code == 202, (posted.text, reusing.text)
    assert parked == 0
    statuses = await rows(
        engine, "SELECT key, status FROM inbox WHERE handler = 'payment.requested' ORDER BY key"
    )
    assert [tuple(r) for r in statuses] == [
        ("amqp-2", "completed"),
        ("http:anonymous:amqp-2", "completed"),
        ("http:anonymous:order-1001", "completed"),
        ("order-1001", "completed"),
    ]
    # And each HTTP client read its own request's result, not the AMQP message's
    assert result_of(http_result)["payment_id"] == "p-http"
    assert result_of(reused_result)["payment_id"] == "p-http-2"
    assert await count(engine, "ledger_entries") == 4


async def test_a_key_of_the_ingress_s_space_sent_over_amqp_is_parked_and_the_client_keeps_it(
    settings: Settings, engine: AsyncEngine
) -> None:
    async with running_worker(settings, payments) as worker:
        # Given a message published over AMQP under a key of the ingress's own key space
        await publish_over_amqp(settings, payment("forged", "mallory", 1), "http:anonymous:k9")

        async def parked() -> bool:
            return worker.stats[Count.DEAD_LETTERED] == 1

        await wait_until(parked, timeout=30)
        # Then it is parked as a reserved key, its effect not applied and its key not taken
        reasons = await rows(engine, "SELECT key, reason, failed_key FROM dead_letters")
        assert [tuple(r) for r in reasons] == [("http:anonymous:k9", "key-reserved", False)]
        assert await count(engine, "inbox") == 0
        assert await count(engine, "ledger_entries") == 0

        # When the client posts that key afterwards, and the same body under another key of
        # the same space is published over AMQP after the request was accepted
        async with ingress(settings) as client:
            posted = await client.post(REQUESTED, json=payment("p9"), headers=keyed("k9"))
            assert posted.status_code == 202, posted.text
            await handled_all(engine, 1)
            await publish_over_amqp(
                settings, payment("forged-2", "mallory", 2), "http:anonymous:k9"
            )

            async def parked_again() -> bool:
                return worker.stats[Count.DEAD_LETTERED] == 2

            await wait_until(parked_again, timeout=30)
            read = await client.get(f"{REQUESTED}/k9")

    # Then the client's request ran under its key, and the second forgery (another body) was
    # parked too, leaving the client's result alone
    assert result_of(read)["payment_id"] == "p9"
    assert await count(engine, "ledger_entries") == 1
    reasons = await rows(engine, "SELECT reason FROM dead_letters")
    assert [r[0] for r in reasons] == ["key-reserved", "key-reserved"]


async def test_the_ingress_s_own_event_delivered_again_is_a_duplicate_not_a_reserved_key(
    settings: Settings, engine: AsyncEngine
) -> None:
    async with running_worker(settings, payments) as worker, ingress(settings) as client:
        # Given a request whose event the relay published and the worker handled
        posted = await client.post(REQUESTED, json=payment("p10"), headers=keyed("k10"))
        await handled_all(engine, 1)
        # When its key and body arrive again over AMQP, as a redelivery or a replay would
        await publish_over_amqp(settings, payment("p10"), "http:anonymous:k10")

        async def absorbed() -> bool:
            return worker.stats[Count.DUPLICATE] == 1

        await wait_until(absorbed, timeout=30)
        parked = worker.stats[Count.DEAD_LETTERED]

    # Then it is a duplicate of the accepted request, not a reserved key
    assert posted.status_code == 202, posted.text
    assert parked == 0
    assert await count(engine, "ledger_entries") == 1


async def test_the_workers_own_events_are_not_served_without_an_allow_list(
    settings: Settings, engine: AsyncEngine
) -> None:
    settled = {**payment("never-paid", "mallory", 10**6), "balance_cents": 10**6}
    async with ingress(settings) as client:
        # When a client posts a payment.settled, an event the payments handler publishes
        forged = await client.post("/messages/payment.settled", json=settled, headers=keyed("f1"))
        read = await client.get("/messages/payment.settled/f1")
        paths = set((await client.get("/openapi.json")).json()["paths"])
        requested = await client.post(REQUESTED, json=payment("p1"), headers=keyed("p1"))

    # Then it is no routing key of the ingress, and nothing reaches the worker
    assert is_problem(forged, 404, "no-handler"), forged.text
    assert is_problem(read, 404, "no-handler"), read.text
    assert not any(path.startswith("/messages/payment.settled") for path in paths)
    assert requested.status_code == 202
    async with running_worker(settings, payments):
        await wait_until(lambda: _notices(engine, 1))
    assert await scalar(engine, "SELECT payment_id FROM settlement_notices") == "p1"


async def _notices(engine: AsyncEngine, expected: int) -> bool:
    return await count(engine, "settlement_notices") >= expected


async def test_a_path_under_messages_that_names_no_message_is_a_problem_404(
    settings: Settings,
) -> None:
    async with ingress(settings) as client:
        answers = [
            await client.get(path)
            for path in ("/messages", "/messages/", f"{REQUESTED}/", f"{REQUESTED}/a%0Ab")
        ]
    for response in answers:
        assert response.status_code == 404, response.text
        assert response.headers["content-type"] == PROBLEM_JSON, response.text


async def test_named_in_the_allow_list_a_published_routing_key_is_served(
    settings: Settings,
) -> None:
    keys = ("payment.requested", "payment.settled")
    async with ingress(settings, ingress_routing_keys=keys) as client:
        paths = set((await client.get("/openapi.json")).json()["paths"])
    assert "/messages/payment.settled" in paths


async def test_an_ingress_left_with_nothing_to_serve_refuses_to_start(
    settings: Settings,
) -> None:
    # Given handlers that each publish the other's routing key (both events of the worker)
    loop = Router()

    @loop.handler("ping", publishes={"pong": dict})
    async def ping(body: dict[str, Any], ctx: Context) -> None: ...

    @loop.handler("pong", publishes={"ping": dict})
    async def pong(body: dict[str, Any], ctx: Context) -> None: ...

    with pytest.raises(ConfigurationError, match="ingress_routing_keys"):
        async with ingress(settings, loop):
            pass


async def test_a_body_with_a_duplicate_name_is_stored_as_the_value_the_handler_validated(
    settings: Settings, engine: AsyncEngine
) -> None:
    # Given a body naming amount_cents twice: a reader keeping the first would read 1
    duplicated = b'{"payment_id": "p1", "account": "alice", "amount_cents": 1, "amount_cents": 100}'
    validated = payment("p1", "alice", 100)  # (what Python's JSON and the handler take: the last)
    async with ingress(settings) as client:
        first = await client.post(REQUESTED, content=duplicated, headers=keyed("p1"))
        same = await client.post(REQUESTED, json=validated, headers=keyed("p1"))
        other = await client.post(REQUESTED, json=payment("p1", "alice", 1), headers=keyed("p1"))

    # Then the event holds the canonical JSON of that value, one amount only
    assert first.status_code == 202, first.text
    body = await scalar(engine, "SELECT body FROM outbox")
    assert bytes(body) == canonical_json(validated)
    assert json.loads(body) == validated
    assert bytes(await scalar(engine, "SELECT fingerprint FROM ingress_requests")) == (
        fingerprint(validated)
    )
    # And the same value is the same request, another is a reused key
    assert same.headers["idempotent-replayed"] == "true"
    assert same.json()["message_id"] == first.json()["message_id"]
    assert is_problem(other, 422, "key-reused"), other.text


async def test_a_body_whose_canonical_form_passes_the_limit_is_413(
    settings: Settings, engine: AsyncEngine
) -> None:
    # Given a body within max_body_bytes whose numbers spell longer canonically (1E2 is 100.0)
    notes = ",".join(["1E2"] * 200)
    body = f'{{"payment_id": "p1", "account": "a", "amount_cents": 1, "notes": [{notes}]}}'
    async with ingress(settings, max_body_bytes=len(body) + 10) as client:
        response = await client.post(REQUESTED, content=body.encode(), headers=keyed("p1"))
    # Then the event the consumer would refuse as too large is refused now
    assert is_problem(response, 413, "body-too-large"), response.text
    assert await nothing_stored(engine)


failing = Router()


@failing.handler("probe.failing")
async def violate_a_constraint(body: dict[str, Any], ctx: Context) -> None:
    """Fails for good with a database error whose text quotes SQL and names a constraint."""
    await ctx.connection.execute(text("INSERT INTO inbox (handler, key) VALUES ('x', NULL)"))


async def test_a_failed_message_shows_a_reason_and_no_sql(
    settings: Settings, engine: AsyncEngine
) -> None:
    async with ingress(settings, failing) as client:
        posted = await client.post("/messages/probe.failing", json={"n": 1}, headers=keyed("f1"))
        async with running_worker(settings, failing):

            async def failed() -> bool:
                status = "SELECT status FROM inbox WHERE handler = 'probe.failing'"
                return bool(await scalar(engine, status) == "failed")

            await wait_until(failed, timeout=30)
        read = await client.get("/messages/probe.failing/f1")

    assert posted.status_code == 202, posted.text
    stored = await scalar(engine, "SELECT error FROM inbox WHERE handler = 'probe.failing'")
    assert "INSERT INTO" in stored or "not-null" in stored  # (what is kept from the client)
    assert read.json()["status"] == "failed"
    assert read.json()["reason"] == "handler-error"
    assert read.json()["error"].startswith("IntegrityError: ")
    for leak in ("INSERT", "SQL", "inbox", "null", "constraint", "violates", "sqlalchemy"):
        assert leak not in read.json()["error"], read.text


@pytest.fixture
def empty_database() -> Iterator[Settings]:
    require_services()
    with testing.empty_database(BASE, prefix="worker_ingress_upgrade") as empty:
        yield empty


async def test_requests_accepted_before_the_upgrade_are_retried_as_then_and_read_by_none(
    empty_database: Settings,
) -> None:
    old = empty_database
    # Given a database at 0004 holding a request accepted then
    await asyncio.to_thread(schema.upgrade, old, None, "0004")
    engine = create_engine(old)
    try:
        async with engine.begin() as conn:
            await conn.execute(
                text(
                    "INSERT INTO ingress_requests "
                    "(handler, key, routing_key, fingerprint, message_id) VALUES "
                    "('payment.requested', 'old-1', 'payment.requested', :fp, "
                    "'00000000-0000-4000-8000-000000000001')"
                ),
                {"fp": fingerprint(payment("p-old"))},
            )
        # When the database is upgraded and the same request is sent again
        await asyncio.to_thread(schema.upgrade, old, payments)
        migrated = await rows(engine, "SELECT client, key, handler_key FROM ingress_requests")
        async with ingress(old) as client:
            retried = await client.post(REQUESTED, json=payment("p-old"), headers=keyed("old-1"))
            changed = await client.post(REQUESTED, json=payment("p-other"), headers=keyed("old-1"))
            read = await client.get(f"{REQUESTED}/old-1")
        events = await count(engine, "outbox")
    finally:
        await engine.dispose()

    # Then the old row belongs to no client, keyed as its event was
    assert [tuple(r) for r in migrated] == [("", "old-1", "old-1")]
    # And the retry is answered as the first request was (no second event), but read by none
    assert retried.status_code == 202, retried.text
    assert retried.json()["message_id"] == "00000000-0000-4000-8000-000000000001"
    assert retried.headers["idempotent-replayed"] == "true"
    assert is_problem(changed, 422, "key-reused"), changed.text
    assert is_problem(read, 404, "unknown-message"), read.text
    assert events == 0


async def test_a_request_whose_event_was_parked_before_its_handler_ran_reads_as_parked(
    settings: Settings, engine: AsyncEngine
) -> None:
    async with ingress(settings) as client:
        # Given a request accepted while the handler took the payments example's body
        posted = await client.post(REQUESTED, json=payment("p-parked"), headers=keyed("k-parked"))
        # When the worker that consumes its event runs a handler whose body type changed since
        async with running_worker(settings, stricter) as worker:

            async def parked() -> bool:
                return worker.stats[Count.DEAD_LETTERED] >= 1

            await wait_until(parked, timeout=30)
        read = await client.get(f"{REQUESTED}/k-parked")
        other = await client.get(f"{REQUESTED}/k-never-posted")

    # Then the client reads that it was parked, and where an operator finds it
    assert posted.status_code == 202, posted.text
    assert read.status_code == 200, read.text
    body = read.json()
    assert (body["status"], body["reason"], body["result"]) == ("parked", "parked", None)
    assert "`worker dlq list --key http:anonymous:k-parked`" in body["error"]
    # And a key nobody posted is still unknown
    assert is_problem(other, 404, "unknown-message"), other.text
    assert await scalar(engine, "SELECT count(*) FROM inbox") == 0
