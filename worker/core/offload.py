"""The checks of a large body (decode, fingerprint, validation) run off the event loop.

Invariant: a body of at most ``INLINE_BODY_BYTES`` is checked where it arrives, so the clean path
pays nothing; a larger one in the one ``worker-decode`` thread, so the event loop waits for it no
longer than one call of the JSON decoder or encoder holds the GIL (a call bounded by
``max_json_items``), and a flood of large bodies queues behind itself, never behind the loop.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from worker.core.batches import Checked, checked
from worker.core.envelope import Delivery, Envelope

INLINE_BODY_BYTES = 16 * 1024
"""The largest body checked on the event loop: a few milliseconds of decoding at most, whatever
it holds (a body of this size holds a few thousand members and elements)."""

T = TypeVar("T")
M = TypeVar("M")

_executor: ThreadPoolExecutor | None = None
_creating = threading.Lock()


def _decoder() -> ThreadPoolExecutor:
    """The one thread large bodies are checked in, started on first use: one suffices, the GIL
    letting no second run beside it, and it keeps the default executor free for what else
    needs it."""
    global _executor
    with _creating:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="worker-decode")
        return _executor


async def checked_by_size(body: bytes, check: Callable[[], T]) -> T:
    """``check()`` (the checks of ``body``): on the event loop when ``body`` is small, else in
    the decoding thread, in the caller's context."""
    if len(body) <= INLINE_BODY_BYTES:
        return check()
    loop = asyncio.get_running_loop()
    call = functools.partial(contextvars.copy_context().run, check)
    return await loop.run_in_executor(_decoder(), call)


async def checked_off_loop(
    deliveries: Sequence[tuple[M, Delivery]], open_one: Callable[[Delivery], Envelope]
) -> Checked[M]:
    """``batches.checked``, the same outcome in the same order, with each large body's checks
    in the decoding thread; a batch of small bodies is checked in one call, as before."""
    if all(len(delivery.body) <= INLINE_BODY_BYTES for _, delivery in deliveries):
        return checked(deliveries, open_one)
    result: Checked[M] = Checked()
    for pair in deliveries:
        one = await checked_by_size(pair[1].body, functools.partial(checked, [pair], open_one))
        result.opened += one.opened
        result.rejected += one.rejected
    return result
