"""Where a batch's bodies are checked: a small one on the event loop, a large one in the decoding
thread, with the same outcomes in the same order as ``batches.checked``."""

from __future__ import annotations

import json
import threading
from typing import Any

from pydantic import BaseModel, model_validator

from worker import Context
from worker.core.batches import checked
from worker.core.envelope import Delivery, Envelope, open_envelope
from worker.core.offload import INLINE_BODY_BYTES, checked_off_loop
from worker.core.router import Router
from worker.errors import BodyTooLarge, InvalidBody

checked_in: list[tuple[str, str]] = []


class Note(BaseModel):
    note_id: str
    text: str

    @model_validator(mode="after")
    def where(self) -> Note:
        checked_in.append((self.note_id, threading.current_thread().name))
        return self


router = Router()


@router.handler("note.added")
async def add(body: Note, ctx: Context) -> None:
    pass


def note(note_id: str, size: int, **extra: Any) -> Delivery:
    body = json.dumps({"note_id": note_id, "text": "x" * size} | extra).encode()
    return Delivery(body, "note.added", headers={"idempotency-key": note_id})


def open_one(delivery: Delivery) -> Envelope:
    return open_envelope(delivery, router, max_body_bytes=1024 * 1024)


async def test_large_bodies_are_checked_in_the_decoding_thread_small_ones_on_the_loop() -> None:
    checked_in.clear()
    batch = [
        ("small", note("small", 100)),
        ("large", note("large", INLINE_BODY_BYTES)),
        ("wide", note("wide", INLINE_BODY_BYTES, **{f"k{i}": 1 for i in range(20_000)})),
        ("invalid", note("invalid", INLINE_BODY_BYTES, text=5)),
        ("last", note("last", 10)),
    ]

    result = await checked_off_loop(batch, open_one)

    assert [m for m, _ in result.opened] == ["small", "large", "last"]
    assert [(m, type(e)) for m, _, e in result.rejected] == [
        ("wide", BodyTooLarge),
        ("invalid", InvalidBody),
    ]
    loop = threading.current_thread().name
    assert dict(checked_in) == {"small": loop, "large": "worker-decode_0", "last": loop}
    same = checked(batch, open_one)
    assert [(m, e.fingerprint) for m, e in result.opened] == [
        (m, e.fingerprint) for m, e in same.opened
    ]


async def test_a_batch_of_small_bodies_is_checked_on_the_loop() -> None:
    checked_in.clear()
    result = await checked_off_loop([(n, note(n, 100)) for n in ("a", "b")], open_one)
    assert [m for m, _ in result.opened] == ["a", "b"]
    assert {thread for _, thread in checked_in} == {threading.current_thread().name}
