"""How the worker waits and retries: every backoff policy, and waiting for the first of several.

All retries go through tenacity with jittered exponential backoff and retry only what
``errors.is_transient`` calls transient; a unit of work is tried again in process only when the
failure policy (``core.policy.decide``) says so. A policy bound to a stop event stops waiting at
shutdown.
At start-up a refusal (a wrong password, a missing database or virtual host, an untrusted
certificate) is not retried: it raises ``AccessRefused`` at the first attempt, naming what to fix.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    before_sleep_log,
    retry_if_exception,
    stop_after_delay,
    wait_exponential,
    wait_random,
)

from worker.core.policy import FailureFacts, PolicySettings, RetryInProcess, decide
from worker.errors import (
    is_transient,
    is_transient_at_start,
    refusals_explained,
    unreachable_service,
)

log = logging.getLogger("worker")

T = TypeVar("T")

STARTUP_TIMEOUT = 60.0
"""Seconds the worker keeps trying to reach PostgreSQL and RabbitMQ when it starts, unless told
otherwise (the ``startup_timeout`` setting).

Each policy logs its retries on ``logger``, the caller's, so a warning names who is retrying."""


class _Starting(AsyncRetrying):
    """Retries that turn a refusal, which they never retry, into ``AccessRefused``."""

    async def __call__(  # type: ignore[override]
        self, fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any
    ) -> T:
        with refusals_explained():
            result: T = await super().__call__(fn, *args, **kwargs)
            return result


def while_starting(logger: logging.Logger = log, within: float = STARTUP_TIMEOUT) -> AsyncRetrying:
    """Retries for connecting at start, for ``within`` seconds, while PostgreSQL or RabbitMQ may
    still be coming up; a refusal raises ``AccessRefused`` at once."""
    return _Starting(
        stop=stop_after_delay(within),
        wait=wait_exponential(multiplier=0.2, max=5),
        retry=retry_if_exception(is_transient_at_start),
        before_sleep=_not_answering_yet(logger, within),
        reraise=True,
    )


def _not_answering_yet(logger: logging.Logger, within: float) -> Callable[[RetryCallState], None]:
    """A start-up retry's WARNING, as a sentence: who does not answer yet, why, and for how long
    the worker keeps trying."""

    def warn(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        service = unreachable_service(exc) if exc is not None else None
        logger.warning(
            "%s not answering yet (%s: %s); trying again in %.1fs (for up to %.0fs since start)",
            service.value if service is not None else "a service",
            type(exc).__name__,
            exc,
            state.upcoming_sleep,
            within,
        )

    return warn


def in_process(attempts: int, logger: logging.Logger = log) -> AsyncRetrying:
    """Up to ``attempts`` tries of a failing unit of work, as long as the failure policy says
    ``RetryInProcess`` (a transient failure), waiting its delay plus up to 0.1 s of jitter."""
    settings = PolicySettings(transient_attempts=attempts)
    jitter = wait_random(0, 0.1)

    def decision(state: RetryCallState) -> RetryInProcess | None:
        outcome = state.outcome
        if outcome is None or not outcome.failed:
            return None
        exc = outcome.exception()
        assert exc is not None
        decided = decide(exc, FailureFacts(tries=state.attempt_number), settings)
        return decided if isinstance(decided, RetryInProcess) else None

    def again(state: RetryCallState) -> bool:
        return decision(state) is not None

    def wait(state: RetryCallState) -> float:
        decided = decision(state)
        return (0.0 if decided is None else decided.delay) + jitter(state)

    return AsyncRetrying(
        retry=again,
        wait=wait,
        before_sleep=before_sleep_log(logger, logging.WARNING),
        reraise=True,
    )


def until_stopped(
    stop: asyncio.Event,
    *,
    initial: float = 0.2,
    maximum: float = 10.0,
    logger: logging.Logger = log,
) -> AsyncRetrying:
    """Retries without a limit until ``stop`` is set; a wait ends early when it is."""

    def stopping(_: RetryCallState) -> bool:
        return stop.is_set()

    async def sleep(seconds: float) -> None:
        await first(stop.wait(), within=seconds)

    return AsyncRetrying(
        stop=stopping,
        wait=wait_exponential(multiplier=initial, max=maximum) + wait_random(0, initial),
        retry=retry_if_exception(is_transient),
        before_sleep=before_sleep_log(logger, logging.WARNING),
        sleep=sleep,
        reraise=True,
    )


def bound_from_now(deadline: asyncio.Timeout, seconds: float | None) -> None:
    """Move ``deadline`` to ``seconds`` from now (None: no deadline): one step of a transaction
    bounded on its own (``asyncio.timeout(None)`` around it, rescheduled step by step)."""
    when = None if seconds is None else asyncio.get_running_loop().time() + seconds
    deadline.reschedule(when)


async def first(
    *awaitables: Awaitable[Any],
    within: float | None = None,
    on_timeout: BaseException | None = None,
) -> None:
    """Wait until the first of ``awaitables`` finishes (re-raising its error) or ``within`` seconds.

    The others are cancelled. When time runs out, ``on_timeout`` is raised if given.
    """
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        done, _ = await asyncio.wait(tasks, timeout=within, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for task in done:
        task.result()
    if not done and on_timeout is not None:
        raise on_timeout
