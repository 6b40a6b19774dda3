"""The HTTP ingress, served by a real uvicorn server in this process and driven with httpx over
sockets, against the real PostgreSQL and (for the end-to-end tests) RabbitMQ and the worker."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy.ext.asyncio import AsyncEngine

from examples.payments import router as payments
from tests.helpers import rows, scalar, wait_until
from tests.integration.support import ROOT, running_worker, worker_environ
from worker.core.codec import fingerprint
from worker.core.router import Router
from worker.errors import ConfigurationError
from worker.ingress import ingress_router
from worker.ingress.problems import PROBLEM_JSON, TYPE_PREFIX
from worker.ingress.reading import MAX_CLIENT_KEY_LENGTH
from worker.ingress.serve import serve, serve_app
from worker.ops.janitor import sweep
from worker.settings import Settings

REQUESTED = "/messages/payment.requested"
TOKEN = "t0ken-for-the-ingress-tests"
JSON = {"content-type": "application/json"}


def payment(payment_id: str, account: str = "alice", amount_cents: int = 100) -> dict[str, Any]:
    return {"payment_id": payment_id, "account": account, "amount_cents": amount_cents}


def keyed(key: str, **headers: str) -> dict[str, str]:
    return {**JSON, "Idempotency-Key": key, **headers}


@contextlib.asynccontextmanager
async def ingress(
    settings: Settings, router: Router = payments, **changes: Any
) -> AsyncIterator[httpx.AsyncClient]:
    """``worker serve``'s ingress for ``router`` (the payments example) on a free port, and a
    client of it."""
    stop = asyncio.Event()
    port: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    served = settings.replace(ingress_host="127.0.0.1", ingress_port=0, **changes)
    task = asyncio.create_task(serve(served, router, stop, started=port.set_result))
    try:
        await asyncio.wait({port, task}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port.result()}") as client:
            yield client
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def count(engine: AsyncEngine, table: str) -> int:
    return int(await scalar(engine, f"SELECT count(*) FROM {table}"))


async def handled(engine: AsyncEngine, handler: str) -> int:
    """Inbox rows of ``handler``."""
    return int(await scalar(engine, "SELECT count(*) FROM inbox WHERE handler = :h", h=handler))


async def nothing_stored(engine: AsyncEngine) -> bool:
    return await count(engine, "ingress_requests") == 0 and await count(engine, "outbox") == 0


def is_problem(response: httpx.Response, status: int, reason: str) -> bool:
    return (
        response.status_code == status
        and response.headers["content-type"] == PROBLEM_JSON
        and response.json()["type"] == TYPE_PREFIX + reason
        and response.json()["status"] == status
    )


async def test_accepted_once_and_the_same_answer_for_a_retry_in_other_spacing(
    settings: Settings, engine: AsyncEngine
) -> None:
    async with ingress(settings) as client:
        # When a message is posted, and posted again in another key order and spacing
        first = await client.post(REQUESTED, json=payment("p1"), headers=keyed("p1"))
        again = await client.post(
            REQUESTED,
            content=b'{ "amount_cents": 100,\n  "account": "alice", "payment_id": "p1" }',
            headers=keyed("p1"),
        )

    # Then both get the same 202, Location and message id
    assert first.status_code == again.status_code == 202
    assert first.headers["location"] == again.headers["location"] == f"{REQUESTED}/p1"
    assert first.json() == again.json()
    assert first.json()["status_url"] == f"{REQUESTED}/p1"
    assert "idempotent-replayed" not in first.headers
    assert again.headers["idempotent-replayed"] == "true"
    # And one request row and one event were written, keyed by the client's key
    requests = await rows(
        engine,
        "SELECT handler, client, key, handler_key, routing_key, fingerprint FROM ingress_requests",
    )
    assert [tuple(r) for r in requests] == [
        (
            "payment.requested",
            "anonymous",
            "p1",
            "http:anonymous:p1",
            "payment.requested",
            fingerprint(payment("p1")),
        )
    ]
    events = await rows(engine, "SELECT message_id, exchange, routing_key, headers FROM outbox")
    assert len(events) == 1
    assert str(events[0].message_id) == first.json()["message_id"]
    assert (events[0].exchange, events[0].routing_key) == (settings.exchange, "payment.requested")
    # (the handler runs under the key in the ingress's own key space)
    assert events[0].headers["idempotency-key"] == first.json()["handler_key"]
    assert first.json()["handler_key"] == "http:anonymous:p1"


async def test_a_key_reused_with_another_body_is_422_and_appends_nothing(
    settings: Settings, engine: AsyncEngine
) -> None:
    async with ingress(settings) as client:
        first = await client.post(REQUESTED, json=payment("p1"), headers=keyed("p1"))
        reused = await client.post(
            REQUESTED, json=payment("p1", amount_cents=7), headers=keyed("p1")
        )

    assert first.status_code == 202
    assert is_problem(reused, 422, "key-reused"), reused.text
    assert reused.json()["title"] == "Idempotency-Key is already used"
    assert await count(engine, "outbox") == 1


@pytest.mark.parametrize(
    ("headers", "reason"),
    [
        (JSON, "missing-key"),
        (keyed(""), "missing-key"),
        (keyed("k" * (MAX_CLIENT_KEY_LENGTH + 1)), "invalid-key"),
        ({**JSON, "Idempotency-Key": "\xe9t\xe9".encode("latin-1")}, "invalid-key"),
    ],
    ids=["missing", "empty", "too-long", "not-utf8"],
)
async def test_a_missing_or_invalid_key_is_400_and_stores_nothing(
    settings: Settings, engine: AsyncEngine, headers: dict[str, str | bytes], reason: str
) -> None:
    async with ingress(settings) as client:
        response = await client.post(REQUESTED, json=payment("p1"), headers=headers)
    assert is_problem(response, 400, reason), response.text
    assert await nothing_stored(engine)


async def test_two_key_headers_are_refused(settings: Settings, engine: AsyncEngine) -> None:
    async with ingress(settings) as client:
        headers = [("content-type", "application/json"), ("idempotency-key", "a")]
        headers.append(("idempotency-key", "b"))
        response = await client.post(REQUESTED, json=payment("p1"), headers=headers)
    assert is_problem(response, 400, "invalid-key"), response.text
    assert await nothing_stored(engine)


async def test_a_key_in_utf8_with_a_slash_comes_back_in_the_location(
    settings: Settings, engine: AsyncEngine
) -> None:
    key = "order/é 1?"
    async with ingress(settings) as client:
        accepted = await client.post(
            REQUESTED,
            json=payment("p1"),
            headers={**JSON, "Idempotency-Key": key.encode()},  # type: ignore[dict-item]
        )
        location = accepted.headers["location"]
        status = await client.get(location)
    assert accepted.status_code == 202, accepted.text
    assert location == f"{REQUESTED}/order%2F%C3%A9%201%3F"
    assert status.json()["status"] == "pending"
    assert await scalar(engine, "SELECT key FROM ingress_requests") == key


async def test_an_unknown_routing_key_is_404(settings: Settings, engine: AsyncEngine) -> None:
    async with ingress(settings) as client:
        posted = await client.post("/messages/no.such", json={}, headers=keyed("k"))
        read = await client.get("/messages/no.such/k")
    assert is_problem(posted, 404, "no-handler"), posted.text
    assert is_problem(read, 404, "no-handler"), read.text
    assert await nothing_stored(engine)


async def test_the_ingress_serves_only_the_routing_keys_it_is_given(
    settings: Settings, engine: AsyncEngine
) -> None:
    # Given an ingress that exposes payment.requested only, not the internal payment.settled
    async with ingress(settings, ingress_routing_keys=("payment.requested",)) as client:
        settled = await client.post(
            "/messages/payment.settled",
            json={**payment("p1"), "balance_cents": 100},
            headers=keyed("k1"),
        )
        requested = await client.post(REQUESTED, json=payment("p2"), headers=keyed("k2"))
        paths = set((await client.get("/openapi.json")).json()["paths"])

    # Then the internal event is unknown there, while the public one is accepted
    assert is_problem(settled, 404, "no-handler"), settled.text
    assert requested.status_code == 202, requested.text
    assert REQUESTED in paths
    assert not any(path.startswith("/messages/payment.settled") for path in paths)
    assert await count(engine, "ingress_requests") == 1


async def test_a_listed_routing_key_no_handler_serves_stops_the_ingress_at_start(
    settings: Settings,
) -> None:
    with pytest.raises(ConfigurationError, match=r"'no\.such'"):
        async with ingress(settings, ingress_routing_keys=("no.such",)):
            pass


@pytest.mark.parametrize(
    ("body", "status", "reason"),
    [
        (b'{"payment_id": "p1", "account": "alice", "amount_cents": "100"}', 422, "invalid"),
        (b'{"payment_id": "p1"', 400, "undecodable"),
        (b"\xff\xfe{}", 400, "undecodable"),
        (b"[" * 65 + b"]" * 65, 400, "body-too-deep"),
        (
            json.dumps(payment("p1") | dict.fromkeys(map(str, range(10_000)), 1)).encode(),
            413,
            "body-too-large",
        ),
    ],
    ids=["invalid", "not-json", "not-utf8", "too-deep", "too-many-names"],
)
async def test_a_body_the_consumer_would_park_is_refused_before_anything_is_stored(
    settings: Settings, engine: AsyncEngine, body: bytes, status: int, reason: str
) -> None:
    async with ingress(settings) as client:
        response = await client.post(REQUESTED, content=body, headers=keyed("p1"))
    assert is_problem(response, status, reason), response.text
    assert await nothing_stored(engine)


async def test_validation_errors_say_where_and_why_without_echoing_the_input(
    settings: Settings,
) -> None:
    async with ingress(settings) as client:
        response = await client.post(
            REQUESTED,
            json={"payment_id": "secret-value", "account": 5, "amount_cents": -1},
            headers=keyed("p1"),
        )
    assert is_problem(response, 422, "invalid"), response.text
    errors = response.json()["errors"]
    assert {tuple(error["loc"]) for error in errors} == {("account",), ("amount_cents",)}
    assert response.json()["errors_total"] == 2
    assert "secret-value" not in response.text


async def test_a_body_not_declared_as_json_is_415(settings: Settings, engine: AsyncEngine) -> None:
    async with ingress(settings) as client:
        form = await client.post(
            REQUESTED, content=json.dumps(payment("p1")), headers={"Idempotency-Key": "p1"}
        )
        bare = await client.post(
            REQUESTED,
            content=json.dumps(payment("p1")),
            headers={"Idempotency-Key": "p1", "content-type": ""},
        )
    assert is_problem(form, 415, "unsupported-media-type"), form.text
    assert is_problem(bare, 415, "unsupported-media-type"), bare.text
    assert await nothing_stored(engine)


async def test_a_body_over_max_body_bytes_is_413_declared_or_streamed(
    settings: Settings, engine: AsyncEngine
) -> None:
    limit = 1024
    big = json.dumps({**payment("p1"), "note": "x" * limit}).encode()

    async def streamed() -> AsyncIterator[bytes]:
        for start in range(0, len(big), 100):
            yield big[start : start + 100]

    async with ingress(settings, max_body_bytes=limit) as client:
        declared = await client.post(REQUESTED, content=big, headers=keyed("p1"))
        chunked = await client.post(REQUESTED, content=streamed(), headers=keyed("p1"))
        within = await client.post(REQUESTED, json=payment("p1"), headers=keyed("p1"))
    assert "content-length" not in chunked.request.headers
    assert is_problem(declared, 413, "body-too-large"), declared.text
    assert is_problem(chunked, 413, "body-too-large"), chunked.text
    assert within.status_code == 202
    assert await count(engine, "outbox") == 1


async def test_with_tokens_a_request_needs_one_and_health_does_not(
    settings: Settings, engine: AsyncEngine
) -> None:
    async with ingress(settings, ingress_tokens=(TOKEN, "another-token-of-16")) as client:
        anonymous = await client.post(REQUESTED, json=payment("p1"), headers=keyed("p1"))
        wrong = await client.post(
            REQUESTED, json=payment("p1"), headers=keyed("p1", authorization=f"Bearer {TOKEN}x")
        )
        other_scheme = await client.post(
            REQUESTED, json=payment("p1"), headers=keyed("p1", authorization=f"Basic {TOKEN}")
        )
        unknown = await client.get("/messages/no.such/p1")
        reading = await client.get(f"{REQUESTED}/p1")
        accepted = await client.post(
            REQUESTED, json=payment("p1"), headers=keyed("p1", authorization=f"bearer {TOKEN}")
        )
        health = await client.get("/healthz")
    for refused in (anonymous, wrong, other_scheme, unknown, reading):
        assert is_problem(refused, 401, "unauthorized"), refused.text
        assert refused.headers["www-authenticate"].startswith("Bearer")
    assert accepted.status_code == 202
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "database": True}
    assert await count(engine, "outbox") == 1


def test_a_short_token_is_refused_at_start() -> None:
    with pytest.raises(ConfigurationError, match="WORKER_INGRESS_TOKENS"):
        Settings.load({"WORKER_INGRESS_TOKENS": "short"})


async def test_get_is_404_then_pending_then_completed_with_the_handlers_result(
    settings: Settings, engine: AsyncEngine
) -> None:
    body = payment("p1", account="alice", amount_cents=250)
    async with ingress(settings) as client:
        unknown = await client.get(f"{REQUESTED}/p1")
        accepted = await client.post(REQUESTED, json=body, headers=keyed("p1"))
        pending = await client.get(accepted.headers["location"])
        async with running_worker(settings, payments):

            async def completed() -> bool:
                return await handled(engine, "payment.requested") == 1

            await wait_until(completed)
        done = await client.get(accepted.headers["location"])

    assert is_problem(unknown, 404, "unknown-message"), unknown.text
    assert pending.json() == {"status": "pending", "result": None, "error": None, "reason": None}
    result = {**body, "balance_cents": 250}
    assert done.json() == {"status": "completed", "result": result, "error": None, "reason": None}
    assert await scalar(engine, "SELECT result FROM inbox WHERE handler = 'payment.requested'") == (
        result
    )


async def test_get_shows_a_failed_handlers_error(settings: Settings, engine: AsyncEngine) -> None:
    async with ingress(settings) as client:
        # the same payment under a second key: the handler refuses to pay it twice
        first = await client.post(REQUESTED, json=payment("p1"), headers=keyed("k1"))
        second = await client.post(REQUESTED, json=payment("p1"), headers=keyed("k2"))
        async with running_worker(settings, payments):

            async def both_done() -> bool:
                return await count(engine, "inbox") >= 2

            await wait_until(both_done)
        failed = await client.get(second.headers["location"])
        completed = await client.get(first.headers["location"])
    assert completed.json()["status"] == "completed"
    assert failed.json()["status"] == "failed"
    assert failed.json()["reason"] == "handler-error"
    assert failed.json()["error"].startswith("DuplicatePayment: ")
    assert "payment p1" not in failed.json()["error"]  # (the stored text stays in the log)
    assert failed.json()["result"] is None


async def test_a_post_whose_transaction_rolls_back_leaves_no_row_and_no_event(
    settings: Settings, engine: AsyncEngine
) -> None:
    async with ingress(settings) as client:
        # Given a trigger that fails the event's insert, after the request row's
        await _refuse_events_of("http:anonymous:doomed", engine)
        try:
            failed = await client.post(REQUESTED, json=payment("p1"), headers=keyed("doomed"))
            stored_nothing = await nothing_stored(engine)
        finally:
            await _stop_refusing(engine)
        # When the client sends the request again
        retried = await client.post(REQUESTED, json=payment("p1"), headers=keyed("doomed"))

    # Then the failed POST left neither a request row nor an event, and the retry is accepted
    assert is_problem(failed, 500, "internal-error"), failed.text
    assert stored_nothing
    assert retried.status_code == 202
    assert "idempotent-replayed" not in retried.headers
    assert await count(engine, "ingress_requests") == await count(engine, "outbox") == 1


async def _refuse_events_of(key: str, engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await conn.exec_driver_sql(
            f"""
            CREATE FUNCTION refuse_event() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF NEW.headers->>'idempotency-key' = '{key}' THEN
                    RAISE EXCEPTION 'refused by the test';
                END IF;
                RETURN NEW;
            END $$
            """
        )
        await conn.exec_driver_sql(
            "CREATE TRIGGER refuse_event BEFORE INSERT ON outbox "
            "FOR EACH ROW EXECUTE FUNCTION refuse_event()"
        )


async def _stop_refusing(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await conn.exec_driver_sql("DROP TRIGGER refuse_event ON outbox")
        await conn.exec_driver_sql("DROP FUNCTION refuse_event()")


async def test_50_clients_sending_every_request_twice_make_one_event_and_one_effect_each(
    settings: Settings, engine: AsyncEngine
) -> None:
    # Given 100 payments over 10 accounts, each to be sent twice, in a shuffled order
    bodies = {f"c{i}": payment(f"c{i}", f"acct-{i % 10}", 100 + i) for i in range(100)}
    sends = [key for key in bodies for _ in range(2)]
    random.Random(16).shuffle(sends)
    queue: asyncio.Queue[str] = asyncio.Queue()
    for key in sends:
        queue.put_nowait(key)
    answers: dict[str, list[httpx.Response]] = {key: [] for key in bodies}

    async with ingress(settings, ingress_pool_size=10) as shared:

        async def client() -> None:
            async with httpx.AsyncClient(base_url=shared.base_url) as own:
                while not queue.empty():
                    key = queue.get_nowait()
                    response = await own.post(REQUESTED, json=bodies[key], headers=keyed(key))
                    answers[key].append(response)

        # When 50 clients send them concurrently
        await asyncio.gather(*(client() for _ in range(50)))

        # Then each key was accepted once: both answers alike, one request row, one event
        for key, (first, second) in answers.items():
            assert first.status_code == second.status_code == 202, (first.text, second.text)
            assert first.json() == second.json(), key
            assert {
                first.headers.get("idempotent-replayed"),
                second.headers.get("idempotent-replayed"),
            } == {None, "true"}
        assert await count(engine, "ingress_requests") == 100
        assert await count(engine, "outbox") == 100

        # And once the worker has run, one effect per key and every GET completed
        async with running_worker(settings, payments):

            async def settled() -> bool:
                return await count(engine, "settlement_notices") == 100

            await wait_until(settled, timeout=60)
        statuses = await asyncio.gather(*(shared.get(f"{REQUESTED}/{key}") for key in bodies))
    assert await count(engine, "ledger_entries") == 100
    balances = dict(await rows(engine, "SELECT account, balance_cents FROM accounts"))
    expected: dict[str, int] = {}
    for body in bodies.values():
        expected[body["account"]] = expected.get(body["account"], 0) + body["amount_cents"]
    assert balances == expected
    for key, status in zip(bodies, statuses, strict=True):
        assert status.json()["status"] == "completed", key
        assert status.json()["result"]["payment_id"] == key


async def test_openapi_documents_each_routing_keys_body_from_its_handlers_model(
    settings: Settings,
) -> None:
    async with ingress(settings) as client:
        document = (await client.get("/openapi.json")).json()
        docs = await client.get("/docs")
    assert docs.status_code == 200
    post = document["paths"][REQUESTED]["post"]
    schema = post["requestBody"]["content"]["application/json"]["schema"]
    assert set(schema["properties"]) == {"payment_id", "account", "amount_cents"}
    assert schema["properties"]["amount_cents"]["exclusiveMinimum"] == 0
    assert any(p["name"] == "Idempotency-Key" and p["required"] for p in post["parameters"])
    assert {"202", "400", "404", "413", "422"} <= set(post["responses"])
    get = document["paths"][f"{REQUESTED}/{{key}}"]["get"]
    assert [(p["name"], p["in"], p["required"]) for p in get["parameters"]] == [
        ("key", "path", True)
    ]
    for operation in (post, get):
        for status, response in operation["responses"].items():
            if status.startswith(("4", "5")):
                assert set(response["content"]) == {PROBLEM_JSON}, (status, response)


async def test_the_router_mounts_under_a_prefix_of_the_users_own_app(
    settings: Settings, engine: AsyncEngine
) -> None:
    # Given the user's own application, with the ingress's routes under /api
    app = FastAPI()
    app.include_router(ingress_router(settings, engine=engine, router=payments), prefix="/api")
    stop = asyncio.Event()
    port: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve_app(app, "127.0.0.1", 0, stop, port.set_result))
    try:
        await asyncio.wait({port, task}, return_when=asyncio.FIRST_COMPLETED)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port.result()}") as client:
            accepted = await client.post(
                f"/api{REQUESTED}", json=payment("p1"), headers=keyed("p1")
            )
            status = await client.get(accepted.headers["location"])
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
    # Then the Location follows the prefix, and leads to the message's status
    assert accepted.status_code == 202
    assert accepted.headers["location"] == f"/api{REQUESTED}/p1"
    assert status.json()["status"] == "pending"


async def test_the_janitor_expires_ingress_requests_with_the_inbox_retention(
    settings: Settings, engine: AsyncEngine
) -> None:
    async with ingress(settings) as client:
        for key in ("old", "new"):
            await client.post(REQUESTED, json=payment(key), headers=keyed(key))
    async with engine.begin() as conn:
        await conn.exec_driver_sql(
            "UPDATE ingress_requests SET accepted_at = now() - interval '8 days' WHERE key = 'old'"
        )

    swept = await sweep(engine, settings)

    assert swept is not None
    assert swept.requests == 1
    assert [row.key for row in await rows(engine, "SELECT key FROM ingress_requests")] == ["new"]


async def test_worker_serve_answers_and_exits_0_on_sigterm(
    settings: Settings, tmp_path: Path
) -> None:
    log = tmp_path / "serve.log"
    process = start_serve(settings, log)
    try:
        port = await served_port(log)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            accepted = await client.post(REQUESTED, json=payment("p1"), headers=keyed("p1"))
        process.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(process.wait, 30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert accepted.status_code == 202
    assert code == 0, log.read_text()
    assert "the ingress stopped" in log.read_text()


async def served_port(log: Path) -> int:
    """The port a ``start_serve`` process listens on, once its log says it serves."""

    def text() -> str:
        return log.read_text()

    async def listening() -> bool:
        return "serving the ingress" in text()

    await wait_until(listening, timeout=30)
    port = re.search(r"http://127\.0\.0\.1:(\d+)", text())
    assert port is not None, text()
    return int(port[1])


def start_serve(settings: Settings, log: Path, **environ: str) -> subprocess.Popen[bytes]:
    """``python -m worker serve --port 0`` for the payments example, its output in ``log``;
    ``environ`` added to its environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKER_")}
    env.update(worker_environ(settings), PYTHONPATH=str(ROOT), WORKER_HANDLERS="examples.payments")
    env.update(environ)
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "worker", "serve", "--port", "0"],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
